//! Attacks on export/import from outside, on the host backend: descriptors
//! that are corrupted, truncated, replayed or mixed with other file
//! descriptors; several importers; an exporter that goes away first; capped
//! pools; many exports at once; interprocess events used in odd orders.
//! Every refusal must be a typed error that maps, reserves and leaks
//! nothing.

use std::io::Write as _;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use tidepool::{Allocation, ExportedAllocation, MemPool, PoolConfig, PoolError};
use tidepool_sys::{Device, HostConfig, HostDevice, IpcEventHandle};

const PAGE: usize = 2 << 20;

fn host() -> Arc<HostDevice> {
    Arc::new(HostDevice::with_config(HostConfig {
        capacity: 256 << 20,
        granularity: PAGE,
    }))
}

fn pool(dev: &Arc<HostDevice>) -> MemPool<HostDevice> {
    MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_exportable(true),
    )
    .expect("pool")
}

fn footprint(dev: &HostDevice) -> (usize, usize, usize) {
    (
        dev.live_handles(),
        dev.live_mappings(),
        dev.live_reservations(),
    )
}

fn dup(e: &ExportedAllocation) -> ExportedAllocation {
    ExportedAllocation {
        descriptor: e.descriptor.clone(),
        fds: e.fds.iter().map(|f| f.try_clone().expect("dup")).collect(),
    }
}

/// A regular file of `bytes` bytes (zeros), opened read-write.
fn regular_file(bytes: usize) -> OwnedFd {
    let path = std::env::temp_dir().join(format!(
        "tidepool-ipc-attack-{}-{:p}",
        std::process::id(),
        &bytes
    ));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("temp file");
    f.set_len(bytes as u64).expect("size");
    let _ = std::fs::remove_file(&path);
    f.into()
}

fn pipe_read_end() -> OwnedFd {
    // A socket pair's end is as wrong a kind of descriptor as a pipe's,
    // and std makes it without unsafe code.
    let (a, _b) = UnixStream::pair().expect("pair");
    a.into()
}

fn expect_bad(r: Result<tidepool::ImportedAllocation, PoolError>, what: &str) {
    match r {
        Err(PoolError::BadDescriptor { .. }) => {}
        Err(e) => panic!("{what}: expected BadDescriptor, got {e:?}"),
        Ok(i) => panic!("{what}: imported at {:#x} ({} bytes)", i.ptr(), i.size()),
    }
}

struct Setup {
    exp_dev: Arc<HostDevice>,
    imp_dev: Arc<HostDevice>,
    exporter: MemPool<HostDevice>,
    importer: MemPool<HostDevice>,
    stream: tidepool_sys::Stream,
}

fn setup() -> Setup {
    let (exp_dev, imp_dev) = (host(), host());
    let exporter = pool(&exp_dev);
    let importer = pool(&imp_dev);
    let stream = exp_dev.create_stream().expect("stream");
    Setup {
        exp_dev,
        imp_dev,
        exporter,
        importer,
        stream,
    }
}

fn alloc(s: &Setup, bytes: usize) -> Allocation {
    s.exporter.alloc_async(bytes, s.stream).expect("alloc")
}

fn put_u64(d: &mut [u8], at: usize, v: u64) {
    d[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

#[test]
fn descriptor_with_overflowing_fields_is_a_typed_error() {
    let s = setup();
    let a = alloc(&s, 2 * PAGE);
    let e = s.exporter.export(&a).unwrap();
    let before = footprint(&s.imp_dev);
    // Offset in the first page (bytes 32..40) near u64::MAX: offset + size
    // overflows.
    let mut bad = dup(&e);
    put_u64(&mut bad.descriptor, 32, u64::MAX - 1);
    expect_bad(s.importer.import(bad), "offset u64::MAX - 1");
    // Page size (bytes 48..56) 2^63, a multiple of the granularity: page *
    // pages overflows.
    let mut bad = dup(&e);
    put_u64(&mut bad.descriptor, 48, 1 << 63);
    expect_bad(s.importer.import(bad), "page size 2^63");
    // Size (bytes 40..48) u64::MAX.
    let mut bad = dup(&e);
    put_u64(&mut bad.descriptor, 40, u64::MAX);
    expect_bad(s.importer.import(bad), "size u64::MAX");
    assert_eq!(footprint(&s.imp_dev), before, "nothing left behind");
    assert_eq!(s.exporter.outstanding_imports(&a), 0);
    drop(e);
    s.exporter.free_async(a, s.stream).unwrap();
}

#[test]
fn every_corrupted_descriptor_byte_is_refused() {
    let s = setup();
    let a = alloc(&s, 3 * PAGE);
    let e = s.exporter.export(&a).unwrap();
    let before = footprint(&s.imp_dev);
    for i in 0..e.descriptor.len() {
        for flip in [0x01u8, 0x80] {
            let mut bad = dup(&e);
            bad.descriptor[i] ^= flip;
            expect_bad(
                s.importer.import(bad),
                &format!("byte {i} flipped by {flip:#x}"),
            );
        }
    }
    // Truncated and extended descriptors.
    let mut bad = dup(&e);
    bad.descriptor.pop();
    expect_bad(s.importer.import(bad), "truncated descriptor");
    let mut bad = dup(&e);
    bad.descriptor.push(0);
    expect_bad(s.importer.import(bad), "extended descriptor");
    assert_eq!(footprint(&s.imp_dev), before, "nothing left behind");
    assert_eq!(s.exporter.outstanding_imports(&a), 0, "no place taken");
    // The genuine descriptor still works after all that.
    let imp = s.importer.import(e).expect("genuine import");
    assert_eq!(imp.size(), 3 * PAGE);
    s.importer.release_import(imp).unwrap();
    s.exporter.free_async(a, s.stream).unwrap();
}

#[test]
fn page_descriptors_of_another_export_are_refused() {
    let s = setup();
    let a = alloc(&s, PAGE);
    let b = alloc(&s, PAGE);
    s.exp_dev.write_words(a.ptr(), &[0xaaaa_aaaa]).unwrap();
    s.exp_dev.write_words(b.ptr(), &[0xbbbb_bbbb]).unwrap();
    let ea = s.exporter.export(&a).unwrap();
    let eb = s.exporter.export(&b).unwrap();
    let before = footprint(&s.imp_dev);
    // a's descriptor and lease, b's page.
    let mut fds = dup(&ea).fds;
    fds[1] = eb.fds[1].try_clone().unwrap();
    let mixed = ExportedAllocation {
        descriptor: ea.descriptor.clone(),
        fds,
    };
    expect_bad(s.importer.import(mixed), "a's lease with b's page");
    assert_eq!(footprint(&s.imp_dev), before);
    assert_eq!(s.exporter.outstanding_imports(&a), 0);
    assert_eq!(s.exporter.outstanding_imports(&b), 0);
    drop((ea, eb));
    s.exporter.free_async(a, s.stream).unwrap();
    s.exporter.free_async(b, s.stream).unwrap();
}

#[test]
fn wrong_kinds_and_numbers_of_descriptors_are_refused() {
    let s = setup();
    let a = alloc(&s, 2 * PAGE);
    let e = s.exporter.export(&a).unwrap();
    let before = footprint(&s.imp_dev);
    let n = e.fds.len();
    assert_eq!(n, 3, "the lease and two pages");
    for slot in 0..n {
        for (kind, fd) in [
            ("socket", pipe_read_end()),
            ("regular file of a page", regular_file(PAGE)),
            ("small regular file", regular_file(4096)),
        ] {
            let mut bad = dup(&e);
            bad.fds[slot] = fd;
            expect_bad(s.importer.import(bad), &format!("{kind} in slot {slot}"));
        }
    }
    // Too few, too many, pages swapped.
    let mut bad = dup(&e);
    bad.fds.pop();
    expect_bad(s.importer.import(bad), "one page missing");
    let mut bad = dup(&e);
    bad.fds.push(e.fds[1].try_clone().unwrap());
    expect_bad(s.importer.import(bad), "one page too many");
    let mut bad = dup(&e);
    bad.fds.swap(1, 2);
    expect_bad(s.importer.import(bad), "pages out of order");
    let mut bad = dup(&e);
    bad.fds.clear();
    expect_bad(s.importer.import(bad), "no descriptors");
    assert_eq!(footprint(&s.imp_dev), before, "nothing left behind");
    assert_eq!(s.exporter.outstanding_imports(&a), 0);
    drop(e);
    s.exporter.free_async(a, s.stream).unwrap();
}

#[test]
fn replayed_descriptor_counts_every_import_and_is_closed_after_the_free() {
    let s = setup();
    let a = alloc(&s, PAGE);
    s.exp_dev.write_words(a.ptr(), &[7, 8, 9]).unwrap();
    let e = s.exporter.export(&a).unwrap();
    let i1 = s.importer.import(dup(&e)).unwrap();
    let i2 = s.importer.import(dup(&e)).unwrap();
    assert_ne!(i1.ptr(), i2.ptr());
    assert_eq!(s.imp_dev.read_words(i2.ptr(), 3).unwrap(), vec![7, 8, 9]);
    assert_eq!(s.exporter.outstanding_imports(&a), 2);
    let a = match s.exporter.free_async(a, s.stream) {
        Err(f) => {
            assert!(
                matches!(f.error, PoolError::ExportInUse { imports: 2, .. }),
                "{:?}",
                f.error
            );
            f.allocation
        }
        Ok(()) => panic!("free while imported twice"),
    };
    s.importer.release_import(i1).unwrap();
    let a = match s.exporter.free_async(a, s.stream) {
        Err(f) => f.allocation,
        Ok(()) => panic!("free while imported once"),
    };
    s.importer.release_import(i2).unwrap();
    s.exporter.free_async(a, s.stream).unwrap();
    let before = footprint(&s.imp_dev);
    match s.importer.import(e) {
        Err(PoolError::ExportClosed { .. }) => {}
        other => panic!("replay after the free: {other:?}"),
    }
    assert_eq!(footprint(&s.imp_dev), before);
    assert_eq!(s.importer.live_imports(), 0);
}

#[test]
fn exports_of_foreign_and_zero_size_allocations_are_refused() {
    let s = setup();
    let other = pool(&s.exp_dev);
    let a = other.alloc_async(PAGE, s.stream).unwrap();
    match s.exporter.export(&a) {
        Err(PoolError::WrongPool { .. }) => {}
        other => panic!("foreign allocation: {other:?}"),
    }
    let z = s.exporter.alloc_async(0, s.stream).unwrap();
    match s.exporter.export(&z) {
        Err(PoolError::NotExportable { .. }) => {}
        other => panic!("zero-size allocation: {other:?}"),
    }
    let plain = MemPool::new(
        s.exp_dev.clone(),
        PoolConfig::default().with_va_size(1 << 30),
    )
    .unwrap();
    let p = plain.alloc_async(PAGE, s.stream).unwrap();
    match plain.export(&p) {
        Err(PoolError::NotExportable { .. }) => {}
        other => panic!("pool without exportable: {other:?}"),
    }
    plain.free_async(p, s.stream).unwrap();
    s.exporter.free_async(z, s.stream).unwrap();
    other.free_async(a, s.stream).unwrap();
}

#[test]
fn several_importers_hold_the_free_until_the_last_release() {
    let s = setup();
    let a = alloc(&s, 4 * PAGE);
    let devs: Vec<_> = (0..3).map(|_| host()).collect();
    let pools: Vec<_> = devs.iter().map(pool).collect();
    let imports: Vec<_> = pools
        .iter()
        .map(|p| p.import(s.exporter.export(&a).unwrap()).unwrap())
        .collect();
    let mut a = Some(a);
    for (k, (p, imp)) in pools.iter().zip(imports).enumerate() {
        let live = 3 - k as u64;
        let alloc = a.take().unwrap();
        assert_eq!(s.exporter.outstanding_imports(&alloc), live);
        match s.exporter.free_async(alloc, s.stream) {
            Err(f) => {
                assert!(
                    matches!(f.error, PoolError::ExportInUse { imports, .. } if imports == live),
                    "{:?}",
                    f.error
                );
                a = Some(f.allocation);
            }
            Ok(()) => panic!("free with {live} imports live"),
        }
        p.release_import(imp).unwrap();
    }
    s.exporter.free_async(a.unwrap(), s.stream).unwrap();
    for d in &devs {
        assert_eq!(footprint(d), (0, 0, 1), "only the pool's reservation");
    }
}

#[test]
fn imports_outlive_a_dropped_exporter() {
    let s = setup();
    let a = alloc(&s, 2 * PAGE);
    let words: Vec<u32> = (0..64).map(|i| 0x1000 + i).collect();
    s.exp_dev
        .write_words(a.ptr() + PAGE as u64, &words)
        .unwrap();
    let imp = s.importer.import(s.exporter.export(&a).unwrap()).unwrap();
    // The exporter's process goes on without freeing: the pool drops with
    // the allocation live and imported.
    let Setup {
        exp_dev,
        imp_dev,
        exporter,
        importer,
        stream: _,
    } = s;
    std::mem::forget(a);
    drop(exporter);
    assert_eq!(footprint(&exp_dev), (0, 0, 0), "the exporter let go");
    assert_eq!(
        imp_dev.read_words(imp.ptr() + PAGE as u64, 64).unwrap(),
        words,
        "the importer still sees the memory"
    );
    importer.release_import(imp).unwrap();
    assert_eq!(footprint(&imp_dev), (0, 0, 1));
}

#[test]
fn export_and_import_leave_pool_accounting_alone() {
    let s = setup();
    let a = alloc(&s, 3 * PAGE);
    let before = s.exporter.stats();
    let e = s.exporter.export(&a).unwrap();
    let after = s.exporter.stats();
    assert_eq!(before.reserved_current, after.reserved_current);
    assert_eq!(before.used_current, after.used_current);
    // An importer capped at one page imports three: imported memory is the
    // exporter's, not the importer's.
    let capped = MemPool::new(
        s.imp_dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_max_size(PAGE as u64)
            .with_exportable(true),
    )
    .unwrap();
    let st0 = capped.stats();
    let imp = capped.import(e).expect("import into a capped pool");
    let st1 = capped.stats();
    assert_eq!(st0.reserved_current, st1.reserved_current);
    assert_eq!(st0.used_current, st1.used_current);
    // The cap still holds for the pool's own memory (on a stream of the
    // capped pool's own device: another device's stream is refused).
    let imp_stream = s.imp_dev.create_stream().expect("importer stream");
    let own = capped.alloc_async(PAGE, imp_stream).expect("own page");
    assert!(capped.alloc_async(PAGE, imp_stream).is_err(), "cap reached");
    capped.free_async(own, imp_stream).unwrap();
    capped.release_import(imp).unwrap();
    s.exporter.free_async(a, s.stream).unwrap();
}

#[test]
fn many_exports_from_several_threads_on_several_streams() {
    let s = Arc::new(setup());
    let rounds = 40;
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                let stream = s.exp_dev.create_stream().unwrap();
                for r in 0..rounds {
                    let bytes = [PAGE / 2, PAGE, 3 * PAGE][(t + r) % 3];
                    let a = s.exporter.alloc_async(bytes, stream).unwrap();
                    s.exp_dev.synchronize_stream(stream).unwrap();
                    let tag = (t * 1000 + r) as u32;
                    s.exp_dev.write_words(a.ptr(), &[tag]).unwrap();
                    let imp = s.importer.import(s.exporter.export(&a).unwrap()).unwrap();
                    assert_eq!(s.imp_dev.read_words(imp.ptr(), 1).unwrap(), vec![tag]);
                    let a = match s.exporter.free_async(a, stream) {
                        Err(f) => f.allocation,
                        Ok(()) => panic!("freed while imported"),
                    };
                    s.importer.release_import(imp).unwrap();
                    s.exporter.free_async(a, stream).unwrap();
                }
                s.exp_dev.synchronize_stream(stream).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    assert_eq!(s.importer.live_imports(), 0);
    assert_eq!(footprint(&s.imp_dev), (0, 0, 1));
}

#[test]
fn interprocess_events_in_odd_orders() {
    let dev = host();
    let s = dev.create_stream().unwrap();
    let (ev, handle) = dev.create_ipc_event().unwrap();
    let other = host();
    let s2 = other.create_stream().unwrap();
    let opened = other.open_ipc_event(handle).unwrap();
    // Wait and synchronise before any record: nothing to wait for.
    other.wait_ipc_event(s2, opened).unwrap();
    other.synchronize_stream(s2).unwrap();
    other.synchronize_ipc_event(opened).unwrap();
    assert!(other.query_ipc_event(opened).unwrap());
    // Record twice, wait on the second.
    dev.record_ipc_event(ev, s).unwrap();
    dev.record_ipc_event(ev, s).unwrap();
    other.wait_ipc_event(s2, opened).unwrap();
    other.synchronize_stream(s2).unwrap();
    assert!(other.query_ipc_event(opened).unwrap());
    // Handles of the wrong kind.
    let bad = IpcEventHandle {
        bytes: b"tidepool-host-ipc-event-v1".to_vec(),
        fd: Some(pipe_read_end()),
    };
    assert!(other.open_ipc_event(bad).is_err(), "a socket is no event");
    let bad = IpcEventHandle {
        bytes: b"something else".to_vec(),
        fd: None,
    };
    assert!(other.open_ipc_event(bad).is_err());
    other.destroy_ipc_event(opened).unwrap();
    assert!(other.destroy_ipc_event(opened).is_err(), "destroyed twice");
    assert!(
        other.record_ipc_event(opened, s2).is_err(),
        "used after destroy"
    );
    dev.destroy_ipc_event(ev).unwrap();
}

#[test]
fn sent_over_a_socket_with_a_closed_peer_is_an_error() {
    let s = setup();
    let a = alloc(&s, PAGE);
    let e = s.exporter.export(&a).unwrap();
    let (tx, rx) = UnixStream::pair().unwrap();
    drop(rx);
    assert!(e.send(&tx).is_err(), "peer closed");
    let (tx, rx) = UnixStream::pair().unwrap();
    // Half a message, then the sender goes away.
    (&tx)
        .write_all(&[0x31, 0x4d, 0x50, 0x54, 64, 0, 0, 0])
        .unwrap();
    drop(tx);
    assert!(ExportedAllocation::recv(&rx).is_err(), "truncated message");
    // Not a socket at all.
    let file = regular_file(4096);
    assert!(e.send(&file).is_err(), "send on a regular file");
    assert!(
        ExportedAllocation::recv(&file).is_err(),
        "recv on a regular file"
    );
    drop(e);
    s.exporter.free_async(a, s.stream).unwrap();
}

const KILLED_ROLE: &str = "TIDEPOOL_ATTACK_KILLED_CHILD";

/// An importer killed while it maps the allocation never gives its place
/// on the lease back: the exporter's free stays refused (and says so), the
/// rest of the pool goes on, and dropping the pool lets everything go.
#[test]
fn importer_killed_while_it_maps() {
    use std::os::unix::net::UnixListener;
    use std::process::{Command, Stdio};
    const NAME: &str = "importer_killed_while_it_maps";
    if let Ok(path) = std::env::var(KILLED_ROLE) {
        // The child: import, say so, then wait to be killed.
        let sock = UnixStream::connect(path).expect("connect");
        let dev = host();
        let p = pool(&dev);
        let imp = p.import(ExportedAllocation::recv(&sock).unwrap()).unwrap();
        tidepool_sys::ipc::send_message(&sock, &imp.ptr().to_le_bytes(), &[]).unwrap();
        std::thread::sleep(std::time::Duration::from_secs(600));
        unreachable!("killed by the parent");
    }
    let s = setup();
    let path = std::env::temp_dir().join(format!("tidepool-attack-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("bind");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env(KILLED_ROLE, &path)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn the test binary");
    let (sock, _) = listener.accept().expect("accept");
    let _ = std::fs::remove_file(&path);
    let a = alloc(&s, 2 * PAGE);
    let other = alloc(&s, PAGE);
    s.exporter.export(&a).unwrap().send(&sock).unwrap();
    let (msg, _) = tidepool_sys::ipc::recv_message(&sock).expect("child imported");
    assert_eq!(msg.len(), 8);
    child.kill().expect("kill the importer");
    child.wait().expect("reap");
    assert_eq!(s.exporter.outstanding_imports(&a), 1, "the dead import");
    let a = match s.exporter.free_async(a, s.stream) {
        Err(f) => {
            assert!(
                matches!(f.error, PoolError::ExportInUse { imports: 1, .. }),
                "{:?}",
                f.error
            );
            f.allocation
        }
        Ok(()) => panic!("freed while a (dead) process maps it"),
    };
    // The rest of the pool works.
    s.exporter.free_async(other, s.stream).unwrap();
    let b = alloc(&s, PAGE);
    s.exporter.free_async(b, s.stream).unwrap();
    // Dropping the pool with the allocation still live releases it all.
    let Setup {
        exp_dev, exporter, ..
    } = s;
    std::mem::forget(a);
    drop(exporter);
    assert_eq!(footprint(&exp_dev), (0, 0, 0), "the exporter let go");
}

/// A refused free must not close, even for a moment, a lease of the
/// allocation: an import racing with it would be told the exporter freed
/// (`ExportClosed`) although the allocation lives on. (When every export
/// had a lease of its own, the free closed an idle one before finding the
/// live one, and reopened it.)
#[test]
fn refused_free_never_closes_a_lease_for_a_moment() {
    let s = Arc::new(setup());
    let a = alloc(&s, PAGE);
    // Export A (its lease first in the allocation's list) stays unimported;
    // export B is imported and held, so every free is refused.
    let ea = s.exporter.export(&a).unwrap();
    let held = s.importer.import(s.exporter.export(&a).unwrap()).unwrap();
    let rounds = 3000;
    let freer = {
        let s = Arc::clone(&s);
        std::thread::spawn(move || {
            let mut a = a;
            for _ in 0..rounds * 4 {
                a = match s.exporter.free_async(a, s.stream) {
                    Err(f) => f.allocation,
                    Ok(()) => panic!("freed while imported"),
                };
            }
            a
        })
    };
    let mut closed = 0;
    for _ in 0..rounds {
        match s.importer.import(dup(&ea)) {
            Ok(imp) => s.importer.release_import(imp).unwrap(),
            Err(PoolError::ExportClosed { .. }) => closed += 1,
            Err(e) => panic!("{e:?}"),
        }
    }
    let a = freer.join().expect("freer");
    assert_eq!(closed, 0, "imports told the live allocation was freed");
    s.importer.release_import(held).unwrap();
    s.exporter.free_async(a, s.stream).unwrap();
}

/// A free that fails for another reason than a live import (here: a free
/// on a stream retired from the pool, refused after the lease was closed)
/// must leave the allocation's exports importable: the allocation lives on.
#[test]
fn failed_free_leaves_exports_open() {
    let s = setup();
    let a = alloc(&s, PAGE);
    let e = s.exporter.export(&a).unwrap();
    let retired = s.exp_dev.create_stream().unwrap();
    s.exporter.retire_stream(retired).unwrap();
    let a = match s.exporter.free_async(a, retired) {
        Err(f) => f.allocation,
        Ok(()) => panic!("a free on a retired stream succeeded"),
    };
    let imp = s
        .importer
        .import(e)
        .expect("the allocation lives: its export must still import");
    assert_eq!(s.exporter.outstanding_imports(&a), 1);
    s.importer.release_import(imp).unwrap();
    s.exporter.free_async(a, s.stream).unwrap();
}

/// An allocation of more pages than one socket message carries
/// descriptors (250 a chunk) travels, imports and reads back whole.
#[test]
fn export_of_many_pages_over_a_socket() {
    const SMALL: usize = 64 << 10;
    let dev = |_| {
        Arc::new(HostDevice::with_config(HostConfig {
            capacity: 64 << 20,
            granularity: SMALL,
        }))
    };
    let (exp_dev, imp_dev) = (dev(0), dev(1));
    let cfg = PoolConfig::default()
        .with_va_size(1 << 30)
        .with_page_size(SMALL)
        .with_exportable(true);
    let exporter = MemPool::new(exp_dev.clone(), cfg.clone()).unwrap();
    let importer = MemPool::new(imp_dev.clone(), cfg).unwrap();
    let s = exp_dev.create_stream().unwrap();
    let pages = 600;
    let a = exporter.alloc_async(pages * SMALL, s).unwrap();
    exp_dev.synchronize_stream(s).unwrap();
    let marks: Vec<u32> = (0..pages as u32).map(|p| 0xA000_0000 | p).collect();
    for (p, m) in marks.iter().enumerate() {
        exp_dev
            .write_words(a.ptr() + (p * SMALL) as u64, &[*m])
            .unwrap();
    }
    let (tx, rx) = UnixStream::pair().unwrap();
    let e = exporter.export(&a).unwrap();
    assert_eq!(e.fds.len(), pages + 1);
    let sender = std::thread::spawn(move || e.send(&tx).map(|()| tx));
    let got = ExportedAllocation::recv(&rx).unwrap();
    let _tx = sender.join().unwrap().unwrap();
    let imp = importer.import(got).unwrap();
    assert_eq!(imp.size(), pages * SMALL);
    for (p, m) in marks.iter().enumerate() {
        let w = imp_dev
            .read_words(imp.ptr() + (p * SMALL) as u64, 1)
            .unwrap();
        assert_eq!(w, vec![*m], "page {p}");
    }
    importer.release_import(imp).unwrap();
    exporter.free_async(a, s).unwrap();
}

/// Dropping an importing pool releases its live imports; work already
/// enqueued on the importer's device that uses them must still find them
/// mapped (the pool waits for its device first, as it does before taking
/// its own memory away).
#[test]
fn dropping_the_importer_waits_for_work_on_its_imports() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let s = setup();
    let a = alloc(&s, PAGE);
    let imp = s.importer.import(s.exporter.export(&a).unwrap()).unwrap();
    let stream = s.imp_dev.create_stream().unwrap();
    // Hold the stream a moment, then write through the import.
    s.imp_dev
        .launch_host(
            stream,
            Box::new(|| std::thread::sleep(std::time::Duration::from_millis(100))),
        )
        .unwrap();
    let wrote = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&wrote);
    s.imp_dev
        .launch_on_words(stream, imp.ptr(), 4, move |w| {
            if let Ok(w) = w {
                w[0].store(0x5eed, Ordering::Relaxed);
                flag.store(true, Ordering::Release);
            }
        })
        .unwrap();
    let _not_released = imp; // the drop of its pool releases it
    let Setup {
        exp_dev,
        imp_dev,
        exporter,
        importer,
        stream: es,
    } = s;
    drop(importer);
    imp_dev.synchronize_stream(stream).unwrap();
    assert!(
        wrote.load(Ordering::Acquire),
        "the enqueued work found the import unmapped"
    );
    assert_eq!(exp_dev.read_words(a.ptr(), 1).unwrap(), vec![0x5eed]);
    assert_eq!(exporter.outstanding_imports(&a), 0, "released by the drop");
    exporter.free_async(a, es).unwrap();
}
