//! Scenarios shared by the host and CUDA tests: each takes a device (through
//! the device trait) and its tag kernels.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use tidepool_kernels::{tag_word, TagKernels};
use tidepool_sys::{Access, AccessDesc, Device, DevicePtr, Physical, PhysicalOptions};

/// A reservation of `reserved` granules whose first `mapped` granules are
/// mapped (read-write for the device when `access`), undone on drop.
pub struct Mapping<'a> {
    pub dev: &'a dyn Device,
    pub ptr: DevicePtr,
    pub granule: usize,
    pub reserved: usize,
    pub mapped: usize,
    phys: Option<Physical>,
}

impl<'a> Mapping<'a> {
    pub fn new(dev: &'a dyn Device, reserved: usize, mapped: usize, access: bool) -> Self {
        let g = dev.granularity();
        let ptr = dev.reserve_va(reserved * g, g).expect("reserve_va");
        let mut m = Mapping {
            dev,
            ptr,
            granule: g,
            reserved,
            mapped,
            phys: None,
        };
        if mapped > 0 {
            let phys = dev
                .create_physical(mapped * g, PhysicalOptions::default())
                .expect("create_physical");
            m.phys = Some(phys);
            dev.map(ptr, mapped * g, phys, 0).expect("map");
            if access {
                dev.set_access(
                    ptr,
                    mapped * g,
                    &[AccessDesc {
                        device: dev.ordinal(),
                        access: Access::ReadWrite,
                    }],
                )
                .expect("set_access");
            }
        }
        m
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.mapped * self.granule
    }
}

impl Drop for Mapping<'_> {
    fn drop(&mut self) {
        if let Some(phys) = self.phys {
            self.dev
                .unmap(self.ptr, self.mapped * self.granule)
                .expect("unmap");
            self.dev.release_physical(phys).expect("release_physical");
        }
        self.dev
            .free_va(self.ptr, self.reserved * self.granule)
            .expect("free_va");
    }
}

/// Fill then verify with the same tag: no mismatches; with another tag:
/// every word mismatches; a sub-range verifies too.
pub fn fill_verify_roundtrip(dev: &dyn Device, k: &dyn TagKernels) {
    let m = Mapping::new(dev, 1, 1, true);
    let s = dev.create_stream().unwrap();
    let len = m.len();
    k.reset_counters().unwrap();
    k.fill_tag(s, m.ptr, len, 0xC0FFEE).unwrap();
    k.verify_tag(s, m.ptr, len, 0xC0FFEE).unwrap();
    assert_eq!(k.mismatches().unwrap(), 0, "same tag must verify");

    k.verify_tag(s, m.ptr, len, 0xBEEF).unwrap();
    assert_eq!(
        k.mismatches().unwrap(),
        (len / 4) as u64,
        "another tag must mismatch every word"
    );

    // A sub-range (the pattern depends on the absolute address).
    k.reset_counters().unwrap();
    k.verify_tag(s, m.ptr + 4096, 8192, 0xC0FFEE).unwrap();
    assert_eq!(
        k.mismatches().unwrap(),
        0,
        "a sub-range of a filled range verifies"
    );

    // A partial overwrite is counted word for word.
    k.fill_tag(s, m.ptr + 64, 40, 7).unwrap();
    k.verify_tag(s, m.ptr, len, 0xC0FFEE).unwrap();
    assert_eq!(k.mismatches().unwrap(), 10);

    // Zero length enqueues nothing.
    k.reset_counters().unwrap();
    k.verify_tag(s, m.ptr, 0, 1).unwrap();
    assert_eq!(k.mismatches().unwrap(), 0);
    assert_eq!(k.access_faults().unwrap(), 0);

    dev.synchronize_stream(s).unwrap();
    dev.destroy_stream(s).unwrap();
}

/// Unaligned ranges are refused before anything is enqueued.
pub fn rejects_unaligned(dev: &dyn Device, k: &dyn TagKernels) {
    let s = dev.default_stream();
    use tidepool_kernels::KernelError;
    assert!(matches!(
        k.fill_tag(s, 0x1000, 6, 1),
        Err(KernelError::UnalignedLength { len: 6 })
    ));
    assert!(matches!(
        k.verify_tag(s, 0x1002, 8, 1),
        Err(KernelError::UnalignedPointer { .. })
    ));
    let msg = k.fill_tag(s, 0x1000, 6, 1).unwrap_err().to_string();
    assert!(msg.contains("multiple of 4"), "{msg}");
}

/// A spin on stream A holds back A's later verify: B fills the tag while A
/// spins, so the verify (after the spin) sees it. Had the verify not waited,
/// it would have seen the old tag and counted every word.
pub fn spin_orders_later_work(dev: &dyn Device, k: &dyn TagKernels) {
    let m = Mapping::new(dev, 1, 1, true);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let len = m.len();
    k.fill_tag(a, m.ptr, len, 1).unwrap();
    dev.synchronize_stream(a).unwrap();
    k.reset_counters().unwrap();

    let spin = Duration::from_millis(400);
    let t0 = Instant::now();
    k.spin(a, spin.as_nanos() as u64).unwrap();
    k.verify_tag(a, m.ptr, len, 2).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    k.fill_tag(b, m.ptr, len, 2).unwrap();
    dev.synchronize_stream(b).unwrap();
    dev.synchronize_stream(a).unwrap();
    let a_done = t0.elapsed();
    // A lower bound only: a loaded machine makes everything slower, never
    // faster. That B does not wait for A is checked, with no clock, by
    // `streams_do_not_wait_for_each_other`.
    assert!(a_done >= spin, "spin of {spin:?} finished after {a_done:?}");
    assert_eq!(
        k.mismatches().unwrap(),
        0,
        "the verify on A ran before the spin on A had finished"
    );
    dev.destroy_stream(a).unwrap();
    dev.destroy_stream(b).unwrap();
}

/// Work on stream B completes while stream A is held (by a host task that
/// waits for the test): streams do not wait for each other. No clock is
/// involved: A stays blocked until B's work is observed done.
pub fn streams_do_not_wait_for_each_other(dev: &dyn Device, k: &dyn TagKernels) {
    let m = Mapping::new(dev, 1, 1, true);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let (release, held) = std::sync::mpsc::channel::<()>();
    dev.launch_host(
        a,
        Box::new(move || {
            let _ = held.recv();
        }),
    )
    .unwrap();
    k.reset_counters().unwrap();
    k.fill_tag(b, m.ptr, m.len(), 5).unwrap();
    k.verify_tag(b, m.ptr, m.len(), 5).unwrap();
    std::thread::scope(|scope| {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        scope.spawn(move || {
            let _ = done_tx.send(dev.synchronize_stream(b));
        });
        // Only a bound against hanging forever if B does wait for A.
        let b_done = done_rx.recv_timeout(Duration::from_secs(120));
        let a_idle = dev.query_stream(a).unwrap();
        let _ = release.send(());
        b_done
            .expect("work on B never completed while A was held: B waits for A")
            .unwrap();
        assert!(!a_idle, "A was held, yet reported idle");
    });
    dev.synchronize_stream(a).unwrap();
    assert_eq!(k.mismatches().unwrap(), 0);
    dev.destroy_stream(a).unwrap();
    dev.destroy_stream(b).unwrap();
}

/// Spin keeps a stream busy about as long as asked.
pub fn spin_takes_its_time(dev: &dyn Device, k: &dyn TagKernels) {
    let s = dev.create_stream().unwrap();
    let t0 = Instant::now();
    k.spin(s, 50_000_000).unwrap();
    dev.synchronize_stream(s).unwrap();
    let took = t0.elapsed();
    // A lower bound only (a loaded machine is slower, never faster).
    assert!(took >= Duration::from_millis(50), "{took:?}");
    dev.destroy_stream(s).unwrap();
}

/// The words a fill writes are `tag_word(tag, address)`, read back through
/// `read` (a backend-specific copy to the host).
pub fn fill_matches_tag_word(
    dev: &dyn Device,
    k: &dyn TagKernels,
    read: &dyn Fn(DevicePtr, usize) -> Vec<u32>,
) {
    let m = Mapping::new(dev, 1, 1, true);
    let s = dev.create_stream().unwrap();
    k.fill_tag(s, m.ptr, m.len(), 0x5EED).unwrap();
    dev.synchronize_stream(s).unwrap();
    let words = read(m.ptr, 4096);
    for (i, w) in words.iter().enumerate() {
        let addr = m.ptr + 4 * i as u64;
        assert_eq!(*w, tag_word(0x5EED, addr), "word {i} at {addr:#x}");
    }
    dev.destroy_stream(s).unwrap();
}

/// Many fills and verifies from several threads on their own streams.
pub fn threads_on_streams(dev: &dyn Device, k: &dyn TagKernels) {
    let m = Mapping::new(dev, 4, 4, true);
    let chunk = m.len() / 8;
    k.reset_counters().unwrap();
    std::thread::scope(|scope| {
        for t in 0..8u32 {
            let base = m.ptr + (t as u64) * chunk as u64;
            scope.spawn(move || {
                let s = dev.create_stream().unwrap();
                for round in 0..20u32 {
                    let tag = t * 1000 + round;
                    k.fill_tag(s, base, chunk, tag).unwrap();
                    k.verify_tag(s, base, chunk, tag).unwrap();
                }
                dev.synchronize_stream(s).unwrap();
                dev.destroy_stream(s).unwrap();
            });
        }
    });
    assert_eq!(k.mismatches().unwrap(), 0);
}

/// A graph captured once and launched `launches` times: it allocates three
/// buffers through graph memory nodes (the third after the first is freed,
/// so the driver may give it the first one's memory), fills each with its
/// tag, verifies them while the others are live, and frees them. After
/// every launch the verify kernels' mismatch count is read back and must
/// be 0, while eager fills and verifies run on another stream in between.
///
/// The capture is begun with the backend's raw begin-capture call (on CUDA
/// `cuStreamBeginCapture` itself), announced to nobody: the capture-state
/// query must see it, with an id that differs from the next capture's.
///
/// `backend_faults` reports failures the backend itself detects (the host
/// backend's failed graph memory nodes; 0 on CUDA, where a fault is a
/// sticky error that the next synchronisation returns).
pub fn captured_graph_replays(
    dev: &dyn Device,
    k: &dyn TagKernels,
    launches: u32,
    backend_faults: &dyn Fn() -> u64,
) {
    use tidepool_sys::{CaptureMode, CaptureStatus, GraphOptions};
    const LEN: usize = 1 << 20;
    const TAGS: [u32; 3] = [0xA11C_0001, 0xA11C_0002, 0xA11C_0003];
    let cap = dev.create_stream().unwrap();
    let run = dev.create_stream().unwrap();
    let eager = dev.create_stream().unwrap();
    k.reset_counters().unwrap();
    // Eager memory, stream-ordered, before the capture.
    let e = dev.graph_alloc(eager, LEN).unwrap();

    assert_eq!(dev.capture_status(cap).unwrap(), CaptureStatus::None);
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    let status = dev.capture_status(cap).unwrap();
    let CaptureStatus::Active { id } = status else {
        panic!("a raw capture must be seen by the capture-state query, got {status:?}");
    };
    assert!(dev.is_capturing(cap).unwrap());
    assert_eq!(dev.capture_status(eager).unwrap(), CaptureStatus::None);

    let a = dev.graph_alloc(cap, LEN).unwrap();
    k.fill_tag(cap, a, LEN, TAGS[0]).unwrap();
    let b = dev.graph_alloc(cap, LEN).unwrap();
    k.fill_tag(cap, b, LEN, TAGS[1]).unwrap();
    // Eager work on another stream while the capture is open: it runs now.
    k.fill_tag(eager, e, LEN, 0xEA6E).unwrap();
    k.verify_tag(cap, a, LEN, TAGS[0]).unwrap();
    k.verify_tag(cap, b, LEN, TAGS[1]).unwrap();
    dev.graph_free(cap, a).unwrap();
    let c = dev.graph_alloc(cap, LEN).unwrap();
    k.fill_tag(cap, c, LEN, TAGS[2]).unwrap();
    k.verify_tag(cap, b, LEN, TAGS[1]).unwrap();
    k.verify_tag(cap, c, LEN, TAGS[2]).unwrap();
    dev.graph_free(cap, b).unwrap();
    dev.graph_free(cap, c).unwrap();
    k.verify_tag(eager, e, LEN, 0xEA6E).unwrap();
    let graph = dev.end_capture(cap).unwrap();
    assert_eq!(dev.capture_status(cap).unwrap(), CaptureStatus::None);
    assert_ne!(a, b, "two live graph allocations share an address");
    assert_ne!(b, c, "two live graph allocations share an address");
    // The eager work ran during the capture; the captured work did not.
    assert_eq!(
        k.mismatches().unwrap(),
        0,
        "eager verify during the capture"
    );
    assert_eq!(k.access_faults().unwrap(), 0);

    let exec = dev
        .instantiate_graph(graph, GraphOptions::default())
        .unwrap();
    for i in 0..launches {
        dev.launch_graph(exec, run).unwrap();
        // Eager work interleaved on another stream.
        k.fill_tag(eager, e, LEN, i).unwrap();
        k.verify_tag(eager, e, LEN, i).unwrap();
        dev.synchronize_stream(run).unwrap();
        assert_eq!(k.mismatches().unwrap(), 0, "launch {i}: tags corrupted");
        assert_eq!(k.access_faults().unwrap(), 0, "launch {i}: access faults");
        assert_eq!(backend_faults(), 0, "launch {i}: graph memory node failed");
    }

    // The same stream captured again: another id.
    dev.begin_capture(cap, CaptureMode::ThreadLocal).unwrap();
    let id2 = dev.capture_status(cap).unwrap().id().unwrap();
    assert_ne!(
        id, id2,
        "two captures of one stream must have different ids"
    );
    let empty = dev.end_capture(cap).unwrap();
    dev.destroy_graph(empty).unwrap();

    dev.destroy_graph_exec(exec).unwrap();
    dev.destroy_graph(graph).unwrap();
    dev.graph_free(eager, e).unwrap();
    dev.synchronize_stream(eager).unwrap();
    for s in [cap, run, eager] {
        dev.destroy_stream(s).unwrap();
    }
}
