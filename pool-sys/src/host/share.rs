//! The host backend's part of sharing: reading access back, and
//! interprocess events made of shared memory.
//!
//! An interprocess event is two 64-bit words in a memfd ([`SharedWords`])
//! that every process holding the event maps: `recorded`, the number of
//! records so far, and `completed`, the highest record whose stream work
//! has run. A record bumps `recorded` and enqueues on the stream a task that
//! raises `completed` to the new count; the event is complete when
//! `completed >= recorded`. A wait enqueues a task that polls (sleeping
//! between polls, 20 µs up to 1 ms) until the count seen at the time of the
//! wait is completed. It is simple and correct for the uses of the tests
//! and examples (record in one process, wait in others); a stream that
//! waits on an event whose recording process died waits forever, as a CUDA
//! stream would.

use super::{HostDevice, HOST_ORDINAL};
use crate::device::{Access, Device, DevicePtr, IpcEvent, IpcEventHandle, Stream};
use crate::error::{Op, SysError, SysResult};
use crate::ipc::SharedWords;
use crate::validate::invalid;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

const RECORDED: usize = 0;
const COMPLETED: usize = 1;
/// Marks the bytes of a host event handle (the descriptor carries the rest).
const HANDLE_TAG: &[u8] = b"tidepool-host-ipc-event-v1";

/// Interprocess events of every host device of this process, by id (ids
/// come from the backend's one counter, so they are never reused).
fn table() -> &'static Mutex<HashMap<u64, Arc<SharedWords>>> {
    static TABLE: OnceLock<Mutex<HashMap<u64, Arc<SharedWords>>>> = OnceLock::new();
    TABLE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn event(op: Op, ev: IpcEvent) -> SysResult<Arc<SharedWords>> {
    super::lock(table())
        .get(&ev.0)
        .cloned()
        .ok_or(SysError::InvalidHandle {
            op,
            what: "interprocess event",
            id: ev.0,
        })
}

fn done(w: &SharedWords, target: u64) -> bool {
    w.word(COMPLETED).load(Ordering::Acquire) >= target
}

fn wait_until(w: &SharedWords, target: u64) {
    let mut nap = Duration::from_micros(20);
    while !done(w, target) {
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(1));
    }
}

fn insert(words: SharedWords) -> IpcEvent {
    let id = super::next_id();
    super::lock(table()).insert(id, Arc::new(words));
    IpcEvent(id)
}

impl HostDevice {
    pub(super) fn get_access_impl(&self, ptr: DevicePtr, device: i32) -> SysResult<Access> {
        let op = Op::GetAccess;
        if device != HOST_ORDINAL {
            return Err(invalid(
                op,
                format!("device {device} does not exist on the host backend (only device 0)"),
            ));
        }
        let vm = super::read(&self.vm);
        match vm.mappings.range(..=ptr).next_back() {
            Some((&start, m)) if ptr < start + m.size as u64 => Ok(m.access),
            _ => Err(invalid(op, format!("{ptr:#x} is not mapped"))),
        }
    }

    pub(super) fn create_ipc_event_impl(&self) -> SysResult<(IpcEvent, IpcEventHandle)> {
        let words = SharedWords::create(2)?;
        let fd = words.share()?;
        Ok((
            insert(words),
            IpcEventHandle {
                bytes: HANDLE_TAG.to_vec(),
                fd: Some(fd),
            },
        ))
    }

    pub(super) fn open_ipc_event_impl(&self, handle: IpcEventHandle) -> SysResult<IpcEvent> {
        let op = Op::Ipc;
        if handle.bytes != HANDLE_TAG {
            return Err(invalid(
                op,
                "not a host-backend interprocess event handle (made by another backend?)",
            ));
        }
        let fd = handle
            .fd
            .ok_or_else(|| invalid(op, "a host interprocess event handle needs its descriptor"))?;
        Ok(insert(SharedWords::open(fd, 2)?))
    }

    pub(super) fn record_ipc_event_impl(&self, ev: IpcEvent, stream: Stream) -> SysResult<()> {
        let w = event(Op::RecordEvent, ev)?;
        let target = w.word(RECORDED).fetch_add(1, Ordering::AcqRel) + 1;
        let task_words = Arc::clone(&w);
        let r = self.launch_host(
            stream,
            Box::new(move || {
                task_words
                    .word(COMPLETED)
                    .fetch_max(target, Ordering::AcqRel);
            }),
        );
        if r.is_err() {
            // Nothing was enqueued: take the record back if it is still the
            // last one (else a later record supersedes it anyway).
            let _ = w.word(RECORDED).compare_exchange(
                target,
                target - 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
        r
    }

    pub(super) fn query_ipc_event_impl(&self, ev: IpcEvent) -> SysResult<bool> {
        let w = event(Op::QueryEvent, ev)?;
        Ok(done(&w, w.word(RECORDED).load(Ordering::Acquire)))
    }

    pub(super) fn synchronize_ipc_event_impl(&self, ev: IpcEvent) -> SysResult<()> {
        let w = event(Op::SynchronizeEvent, ev)?;
        wait_until(&w, w.word(RECORDED).load(Ordering::Acquire));
        Ok(())
    }

    pub(super) fn wait_ipc_event_impl(&self, stream: Stream, ev: IpcEvent) -> SysResult<()> {
        let w = event(Op::WaitEvent, ev)?;
        let target = w.word(RECORDED).load(Ordering::Acquire);
        if done(&w, target) {
            return Ok(());
        }
        self.launch_host(stream, Box::new(move || wait_until(&w, target)))
    }

    pub(super) fn destroy_ipc_event_impl(&self, ev: IpcEvent) -> SysResult<()> {
        super::lock(table())
            .remove(&ev.0)
            .map(drop)
            .ok_or(SysError::InvalidHandle {
                op: Op::DestroyEvent,
                what: "interprocess event",
                id: ev.0,
            })
    }
}
