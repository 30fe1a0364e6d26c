//! The cross-process scenario of the IPC tests, generic over the backend:
//! a root process allocates one buffer, exports it to N child processes
//! (the test binary itself, started with `--exact <test>` and an
//! environment variable that selects the child role), each child verifies
//! the root's pattern through its import, writes its own slice in stream
//! order and hands an interprocess event back; the root waits on each
//! event (on its stream, and on the host), verifies every slice, checks
//! that its free is refused while imports are live, and frees once every
//! child has released.
#![allow(dead_code)]

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;
use tidepool::{ExportedAllocation, MemPool, PoolConfig, PoolError};
use tidepool_sys::ipc::{recv_message, send_message};
use tidepool_sys::{Device, DevicePtr, IpcEventHandle, Stream};

pub const ROLE: &str = "TIDEPOOL_IPC_ROLE";
pub const SOCK: &str = "TIDEPOOL_IPC_SOCK";
pub const RANK: &str = "TIDEPOOL_IPC_RANK";

/// Bytes each child writes: one and a half pages of 2 MiB, so slices
/// straddle page boundaries and the buffer spans several pages.
pub const SLICE: usize = 3 << 20;

/// What the scenario needs from a backend besides the device trait.
pub trait Mem: Device {
    /// Write words now (not in stream order).
    fn put(&self, ptr: DevicePtr, words: &[u32]);
    /// Read words now (after the caller synchronised what it needs).
    fn get(&self, ptr: DevicePtr, count: usize) -> Vec<u32>;
    /// Set `count` words to `value` in stream order.
    fn fill_async(&self, stream: Stream, ptr: DevicePtr, value: u32, count: usize);
}

pub fn root_word(i: usize) -> u32 {
    0xA5A5_0000 ^ (i as u32).wrapping_mul(2_654_435_761)
}

pub fn child_word(rank: usize) -> u32 {
    0xC0DE_0000 | rank as u32
}

pub fn skip(test: &str, reason: &str) {
    let _ = writeln!(std::io::stderr().lock(), "SKIP {test}: {reason}");
}

fn sock_path(test: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "tidepool-{}-{}-{}.sock",
        test.replace("::", "-"),
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    ))
}

fn spawn_child(test: &str, sock: &PathBuf, rank: usize) -> Child {
    Command::new(std::env::current_exe().expect("test binary path"))
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, "child")
        .env(SOCK, sock)
        .env(RANK, rank.to_string())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn the test binary as a child")
}

/// Whether this process is a child started by [`root`].
pub fn is_child() -> bool {
    std::env::var(ROLE).as_deref() == Ok("child")
}

/// The root's side: `n` children, `device` the root's device.
pub fn root<D: Mem>(test: &str, device: Arc<D>, n: usize) {
    let path = sock_path(test);
    let listener = UnixListener::bind(&path).expect("bind the socket");
    let pool = MemPool::new(
        device.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_exportable(true),
    )
    .expect("exportable pool");
    let stream = device.create_stream().expect("stream");
    let total = SLICE * n;
    let words = total / 4;
    let buf = pool.alloc_async(total, stream).expect("alloc");
    device.synchronize_stream(stream).expect("sync");
    let pattern: Vec<u32> = (0..words).map(root_word).collect();
    device.put(buf.ptr(), &pattern);

    let mut children: Vec<Child> = (0..n).map(|r| spawn_child(test, &path, r)).collect();
    let mut socks = Vec::new();
    for _ in 0..n {
        let (s, _) = listener.accept().expect("accept a child");
        s.set_read_timeout(Some(Duration::from_secs(120))).ok();
        socks.push(s);
    }
    // Each child says its rank first (connections arrive in any order).
    let mut by_rank: Vec<Option<UnixStream>> = (0..n).map(|_| None).collect();
    for s in socks {
        let (hello, _) = recv_message(&s).expect("hello");
        let rank = u32::from_le_bytes(hello[..4].try_into().unwrap()) as usize;
        by_rank[rank] = Some(s);
    }
    let socks: Vec<UnixStream> = by_rank
        .into_iter()
        .map(|s| s.expect("every rank"))
        .collect();
    for s in &socks {
        pool.export(&buf)
            .expect("export")
            .send(s)
            .expect("send export");
    }
    // Each child: its event, recorded after its stream-ordered write.
    for (rank, s) in socks.iter().enumerate() {
        let (bytes, mut fds) = recv_message(s).expect("event handle");
        let ev = device
            .open_ipc_event(IpcEventHandle {
                bytes,
                fd: fds.pop(),
            })
            .expect("open the child's event");
        let off = rank * SLICE;
        if rank % 2 == 0 {
            // Stream order: the root's stream waits on the child's event.
            device.wait_ipc_event(stream, ev).expect("wait event");
            device.synchronize_stream(stream).expect("sync");
        } else {
            device.synchronize_ipc_event(ev).expect("sync event");
        }
        assert!(device.query_ipc_event(ev).expect("query"), "event complete");
        let got = device.get(buf.ptr() + off as u64, SLICE / 4);
        let bad = got.iter().filter(|&&w| w != child_word(rank)).count();
        assert_eq!(
            bad, 0,
            "rank {rank}: {bad} words not written by the child before its event"
        );
        device.destroy_ipc_event(ev).expect("close event");
    }
    // Imports are live: the free must be refused, and lose nothing.
    assert_eq!(pool.outstanding_imports(&buf), n as u64);
    let err = pool
        .free_async(buf, stream)
        .expect_err("free while imported");
    assert!(
        matches!(err.error, PoolError::ExportInUse { imports, .. } if imports == n as u64),
        "{:?}",
        err.error
    );
    let buf = err.allocation;
    for s in &socks {
        send_message(s, b"verified", &[]).expect("tell the child");
    }
    for (rank, s) in socks.iter().enumerate() {
        let (msg, _) = recv_message(s).expect("release report");
        assert_eq!(msg, b"released", "rank {rank}");
    }
    for (rank, c) in children.iter_mut().enumerate() {
        let status = c.wait().expect("wait child");
        assert!(status.success(), "child {rank} failed: {status}");
    }
    assert_eq!(pool.outstanding_imports(&buf), 0);
    // The children's writes are visible here too, and the root's pattern
    // is gone only where they wrote.
    let all = device.get(buf.ptr(), words);
    for (i, &w) in all.iter().enumerate() {
        assert_eq!(w, child_word(i * 4 / SLICE), "word {i}");
    }
    pool.free_async(buf, stream)
        .expect("free after every release");
    pool.synchronize().expect("sync pool");
    assert_eq!(pool.stats().used_current, 0);
    let _ = std::fs::remove_file(&path);
}

/// The child's side.
pub fn child<D: Mem>(device: Arc<D>) {
    let rank: usize = std::env::var(RANK).unwrap().parse().unwrap();
    let s = UnixStream::connect(std::env::var(SOCK).unwrap()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).ok();
    send_message(&s, &(rank as u32).to_le_bytes(), &[]).expect("hello");
    let pool = MemPool::new(device.clone(), PoolConfig::default().with_va_size(1 << 30))
        .expect("child pool");
    let exported = ExportedAllocation::recv(&s).expect("receive export");
    let imp = pool.import(exported).expect("import");
    let n_words = imp.size() / 4;
    // The root's pattern, seen through this process's own mapping.
    let got = device.get(imp.ptr(), n_words);
    let bad = (0..n_words).filter(|&i| got[i] != root_word(i)).count();
    assert_eq!(
        bad, 0,
        "rank {rank}: {bad} words differ from the root's pattern"
    );
    let stream = device.create_stream().expect("stream");
    // Hold the stream a moment so that a root that did not wait for the
    // event would read the old pattern.
    device
        .launch_host(
            stream,
            Box::new(|| std::thread::sleep(Duration::from_millis(100))),
        )
        .expect("delay");
    let off = (rank * SLICE) as u64;
    device.fill_async(stream, imp.ptr() + off, child_word(rank), SLICE / 4);
    let (ev, handle) = device.create_ipc_event().expect("ipc event");
    device.record_ipc_event(ev, stream).expect("record");
    let fds: Vec<_> = handle
        .fd
        .iter()
        .map(|f| std::os::fd::AsFd::as_fd(f))
        .collect();
    send_message(&s, &handle.bytes, &fds).expect("send event");
    let (msg, _) = recv_message(&s).expect("root verified");
    assert_eq!(msg, b"verified");
    device.synchronize_stream(stream).expect("sync");
    pool.release_import(imp).expect("release");
    device.destroy_ipc_event(ev).expect("destroy event");
    send_message(&s, b"released", &[]).expect("report");
}
