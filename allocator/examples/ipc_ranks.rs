//! Several processes write into one buffer of one pool, through IPC.
//!
//! The root process allocates a buffer from an exportable pool, starts N
//! child processes (this same binary), and sends each an export of the
//! buffer over a Unix socket (descriptor bytes plus file descriptors, via
//! `SCM_RIGHTS`). Each child imports the buffer into its own address space,
//! writes its slice in stream order, records an interprocess event after
//! the write and sends the event's handle back. The root makes its stream
//! wait on every child's event, verifies every slice, tells the children,
//! and frees the buffer once every child has released its import.
//!
//! ```text
//! cargo run --release --example ipc_ranks -- [--ranks N] [--cuda] [--slice-mib M]
//! ```
//! Without `--cuda` it runs on the host backend (memfd memory, shared
//! memory events), so it works on any Linux machine.

use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::Command;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tidepool::{ExportedAllocation, MemPool, PoolConfig};
use tidepool_sys::cuda::CudaDevice;
use tidepool_sys::ipc::{recv_message, send_message};
use tidepool_sys::{Device, DevicePtr, HostDevice, IpcEventHandle, Stream};

type Error = Box<dyn std::error::Error>;

/// The few memory operations the example needs beyond the device trait.
trait Mem: Device {
    fn fill_async(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        value: u32,
        words: usize,
    ) -> Result<(), Error>;
    fn read(&self, ptr: DevicePtr, words: usize) -> Result<Vec<u32>, Error>;
}

impl Mem for HostDevice {
    fn fill_async(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        value: u32,
        words: usize,
    ) -> Result<(), Error> {
        self.launch_on_words(stream, ptr, words * 4, move |w| match w {
            Ok(w) => w.iter().for_each(|x| x.store(value, Ordering::Relaxed)),
            Err(e) => tracing::error!(error = %e, "fill failed"),
        })?;
        Ok(())
    }
    fn read(&self, ptr: DevicePtr, words: usize) -> Result<Vec<u32>, Error> {
        Ok(self.read_words(ptr, words)?)
    }
}

impl Mem for CudaDevice {
    fn fill_async(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        value: u32,
        words: usize,
    ) -> Result<(), Error> {
        Ok(self.memset_d32_async(stream, ptr, value, words)?)
    }
    fn read(&self, ptr: DevicePtr, words: usize) -> Result<Vec<u32>, Error> {
        let mut b = vec![0u8; words * 4];
        self.copy_dtoh(&mut b, ptr)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

fn value(rank: usize) -> u32 {
    0x7100_0000 | rank as u32
}

struct Args {
    ranks: usize,
    cuda: bool,
    slice: usize,
}

fn args() -> Args {
    let mut a = Args {
        ranks: 4,
        cuda: false,
        slice: 3 << 20,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        match v[i].as_str() {
            "--cuda" => a.cuda = true,
            "--ranks" => {
                i += 1;
                a.ranks = v[i].parse().expect("--ranks N");
            }
            "--slice-mib" => {
                i += 1;
                a.slice = v[i].parse::<usize>().expect("--slice-mib M") << 20;
            }
            other => panic!("unknown argument {other}"),
        }
        i += 1;
    }
    a
}

fn main() -> Result<(), Error> {
    let a = args();
    let child = std::env::var("IPC_RANKS_CHILD").ok();
    if a.cuda {
        let dev = Arc::new(CudaDevice::new(0)?);
        match child {
            Some(rank) => run_child(dev, rank.parse()?, a.slice),
            None => run_root(dev, &a),
        }
    } else {
        let dev = Arc::new(HostDevice::new());
        match child {
            Some(rank) => run_child(dev, rank.parse()?, a.slice),
            None => run_root(dev, &a),
        }
    }
}

fn run_root<D: Mem>(dev: Arc<D>, a: &Args) -> Result<(), Error> {
    let path = std::env::temp_dir().join(format!("tidepool-ipc-ranks-{}.sock", std::process::id()));
    let listener = UnixListener::bind(&path)?;
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_exportable(true))?;
    let stream = dev.create_stream()?;
    let total = a.slice * a.ranks;
    let buf = pool.alloc_async(total, stream)?;
    let mut children = Vec::new();
    for rank in 0..a.ranks {
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.env("IPC_RANKS_CHILD", rank.to_string())
            .env("IPC_RANKS_SOCK", &path)
            .args(["--slice-mib", &(a.slice >> 20).to_string()]);
        if a.cuda {
            cmd.arg("--cuda");
        }
        children.push(cmd.spawn()?);
    }
    let mut socks: Vec<Option<UnixStream>> = (0..a.ranks).map(|_| None).collect();
    for _ in 0..a.ranks {
        let (s, _) = listener.accept()?;
        let (hello, _) = recv_message(&s)?;
        let rank = u32::from_le_bytes(hello[..4].try_into()?) as usize;
        socks[rank] = Some(s);
    }
    let socks: Vec<UnixStream> = socks
        .into_iter()
        .map(|s| s.expect("every rank connected"))
        .collect();
    for s in &socks {
        pool.export(&buf)?.send(s)?;
    }
    let mut events = Vec::new();
    for s in &socks {
        let (bytes, mut fds) = recv_message(s)?;
        let ev = dev.open_ipc_event(IpcEventHandle {
            bytes,
            fd: fds.pop(),
        })?;
        // The root's stream waits for the child's write, in stream order.
        dev.wait_ipc_event(stream, ev)?;
        events.push(ev);
    }
    dev.synchronize_stream(stream)?;
    let mut wrong = 0usize;
    for rank in 0..a.ranks {
        let got = dev.read(buf.ptr() + (rank * a.slice) as u64, a.slice / 4)?;
        wrong += got.iter().filter(|&&w| w != value(rank)).count();
    }
    for ev in events {
        dev.destroy_ipc_event(ev)?;
    }
    for s in &socks {
        send_message(s, b"verified", &[])?;
    }
    for s in &socks {
        let (msg, _) = recv_message(s)?;
        assert_eq!(msg, b"released");
    }
    let mut failed_children = 0;
    for mut c in children {
        if !c.wait()?.success() {
            failed_children += 1;
        }
    }
    pool.free_async(buf, stream)?;
    pool.synchronize()?;
    let _ = std::fs::remove_file(&path);
    println!(
        "{{\"example\":\"ipc_ranks\",\"backend\":\"{}\",\"ranks\":{},\"bytes\":{total},\"wrong_words\":{wrong},\"failed_children\":{failed_children}}}",
        dev.backend_name(),
        a.ranks
    );
    if wrong > 0 || failed_children > 0 {
        return Err("verification failed".into());
    }
    Ok(())
}

fn run_child<D: Mem>(dev: Arc<D>, rank: usize, slice: usize) -> Result<(), Error> {
    let s = UnixStream::connect(std::env::var("IPC_RANKS_SOCK")?)?;
    send_message(&s, &(rank as u32).to_le_bytes(), &[])?;
    let pool = MemPool::new(dev.clone(), PoolConfig::default())?;
    let imported = pool.import(ExportedAllocation::recv(&s)?)?;
    let stream = dev.create_stream()?;
    dev.fill_async(
        stream,
        imported.ptr() + (rank * slice) as u64,
        value(rank),
        slice / 4,
    )?;
    let (ev, handle) = dev.create_ipc_event()?;
    dev.record_ipc_event(ev, stream)?;
    let fds: Vec<_> = handle.fd.iter().map(|f| f.as_fd()).collect();
    send_message(&s, &handle.bytes, &fds)?;
    let (msg, _) = recv_message(&s)?;
    assert_eq!(msg, b"verified");
    dev.synchronize_stream(stream)?;
    pool.release_import(imported)?;
    dev.destroy_ipc_event(ev)?;
    send_message(&s, b"released", &[])?;
    Ok(())
}
