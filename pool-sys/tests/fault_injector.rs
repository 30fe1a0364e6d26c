//! The fault-injecting wrapper fails exactly the calls it is asked to, and
//! forwards everything else unchanged.

use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{Device, FaultInjector, Op, PhysicalOptions, SysError};

const GRAN: usize = 2 << 20;

fn injector() -> FaultInjector<HostDevice> {
    FaultInjector::new(HostDevice::with_config(HostConfig {
        capacity: 256 << 20,
        granularity: GRAN,
    }))
}

fn injected(op: Op, call: u64) -> SysError {
    SysError::Injected { op, call }
}

#[test]
fn fail_nth_fires_on_the_nth_call_only_and_only_once() {
    let f = injector();
    // Calls made before the rule do not count towards n.
    let s0 = f.create_stream().unwrap();
    f.fail_nth(Op::CreateStream, 3, injected(Op::CreateStream, 3));
    let mut results = Vec::new();
    for _ in 0..6 {
        results.push(f.create_stream());
    }
    for (i, r) in results.iter().enumerate() {
        if i == 2 {
            assert_eq!(r, &Err(injected(Op::CreateStream, 3)), "call {}", i + 1);
        } else {
            assert!(r.is_ok(), "call {} should succeed: {r:?}", i + 1);
        }
    }
    assert_eq!(f.calls(Op::CreateStream), 7);
    // Other ops are untouched.
    assert!(f.create_event().is_ok());
    assert_eq!(f.calls(Op::CreateEvent), 1);
    assert_eq!(f.calls(Op::Map), 0);
    for s in results.into_iter().flatten().chain([s0]) {
        f.destroy_stream(s).unwrap();
    }
}

#[test]
fn failed_call_does_not_reach_the_inner_device() {
    let f = injector();
    let free = f.mem_info().unwrap().free;
    f.fail_nth(
        Op::CreatePhysical,
        1,
        SysError::OutOfMemory {
            op: Op::CreatePhysical,
            requested: GRAN,
            available: 0,
        },
    );
    let r = f.create_physical(GRAN, PhysicalOptions::default());
    assert!(r.as_ref().is_err_and(SysError::is_out_of_memory), "{r:?}");
    assert_eq!(f.inner().mem_info().unwrap().free, free, "no memory taken");
    assert_eq!(f.inner().live_handles(), 0);
    let h = f.create_physical(GRAN, PhysicalOptions::default()).unwrap();
    assert_eq!(f.inner().live_handles(), 1);
    f.release_physical(h).unwrap();
}

#[test]
fn fail_from_fails_every_call_from_n_until_cleared() {
    let f = injector();
    let va = f.reserve_va(8 * GRAN, 0).unwrap();
    // One handle a page: a handle maps only whole.
    let h: Vec<_> = (0..8)
        .map(|_| f.create_physical(GRAN, PhysicalOptions::default()).unwrap())
        .collect();
    f.fail_from(Op::Map, 2, injected(Op::Map, 0));
    let at = |i: usize| va + (i * GRAN) as u64;
    assert!(f.map(at(0), GRAN, h[0], 0).is_ok());
    for (i, &hi) in h.iter().enumerate().take(5).skip(1) {
        assert_eq!(f.map(at(i), GRAN, hi, 0), Err(injected(Op::Map, 0)));
    }
    assert_eq!(f.inner().live_mappings(), 1);
    f.clear();
    assert!(f.map(at(1), GRAN, h[1], 0).is_ok());
    assert_eq!(f.calls(Op::Map), 6);
    assert_eq!(f.inner().live_mappings(), 2);
}

#[test]
fn several_rules_and_inner_errors_pass_through() {
    let f = injector();
    let e = f.create_event().unwrap();
    f.fail_nth(Op::QueryEvent, 1, injected(Op::QueryEvent, 1));
    f.fail_nth(Op::QueryEvent, 3, injected(Op::QueryEvent, 3));
    let r: Vec<_> = (0..4).map(|_| f.query_event(e)).collect();
    assert_eq!(
        r,
        vec![
            Err(injected(Op::QueryEvent, 1)),
            Ok(true),
            Err(injected(Op::QueryEvent, 3)),
            Ok(true)
        ]
    );
    // Real errors of the inner device come back unchanged.
    f.destroy_event(e).unwrap();
    assert!(matches!(
        f.destroy_event(e),
        Err(SysError::InvalidHandle {
            op: Op::DestroyEvent,
            ..
        })
    ));
    // Forwarded plain getters.
    assert_eq!(f.backend_name(), "host");
    assert_eq!(f.granularity(), GRAN);
    assert_eq!(f.default_stream(), f.inner().default_stream());
}

#[test]
fn every_fallible_op_can_be_failed() {
    let f = injector();
    let s = f.default_stream();
    let err = |op| injected(op, 1);
    for &op in Op::ALL {
        f.fail_nth(op, 1, err(op));
    }
    let e = tidepool_sys::Event(1);
    let h = tidepool_sys::Physical(1);
    assert_eq!(f.reserve_va(GRAN, 0), Err(err(Op::ReserveVa)));
    assert_eq!(f.free_va(0, GRAN), Err(err(Op::FreeVa)));
    assert_eq!(
        f.create_physical(GRAN, PhysicalOptions::default()),
        Err(err(Op::CreatePhysical))
    );
    assert_eq!(f.release_physical(h), Err(err(Op::ReleasePhysical)));
    assert_eq!(f.map(0, GRAN, h, 0), Err(err(Op::Map)));
    assert_eq!(f.unmap(0, GRAN), Err(err(Op::Unmap)));
    assert_eq!(f.set_access(0, GRAN, &[]), Err(err(Op::SetAccess)));
    assert_eq!(f.export_fd(h).err(), Some(err(Op::ExportHandle)));
    let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    assert_eq!(f.import_fd(fd, GRAN), Err(err(Op::ImportHandle)));
    assert_eq!(f.mem_info(), Err(err(Op::MemInfo)));
    assert_eq!(f.create_stream(), Err(err(Op::CreateStream)));
    assert_eq!(f.destroy_stream(s), Err(err(Op::DestroyStream)));
    assert_eq!(f.adopt_stream(0), Err(err(Op::AdoptStream)));
    assert_eq!(f.synchronize_stream(s), Err(err(Op::SynchronizeStream)));
    assert_eq!(f.query_stream(s), Err(err(Op::QueryStream)));
    assert_eq!(f.is_capturing(s), Err(err(Op::IsCapturing)));
    assert_eq!(f.check_stream(s), Err(err(Op::CheckStream)));
    assert_eq!(f.create_event(), Err(err(Op::CreateEvent)));
    assert_eq!(f.record_event(e, s), Err(err(Op::RecordEvent)));
    assert_eq!(f.query_event(e), Err(err(Op::QueryEvent)));
    assert_eq!(f.synchronize_event(e), Err(err(Op::SynchronizeEvent)));
    assert_eq!(f.destroy_event(e), Err(err(Op::DestroyEvent)));
    assert_eq!(f.wait_event(s, e), Err(err(Op::WaitEvent)));
    let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let r2 = std::sync::Arc::clone(&ran);
    assert_eq!(
        f.launch_host(
            s,
            Box::new(move || r2.store(true, std::sync::atomic::Ordering::SeqCst))
        ),
        Err(err(Op::LaunchHost))
    );
    f.inner().synchronize_stream(s).unwrap();
    assert!(
        !ran.load(std::sync::atomic::Ordering::SeqCst),
        "failed launch must not run"
    );
    // Each rule fired once: the second round succeeds.
    assert!(f.mem_info().is_ok());
    assert!(f.create_stream().is_ok());
}

#[test]
fn rules_are_thread_safe_and_fire_exactly_once() {
    let f = std::sync::Arc::new(injector());
    f.fail_nth(Op::MemInfo, 500, injected(Op::MemInfo, 500));
    let failures: usize = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let f = &f;
                sc.spawn(move || (0..250).filter(|_| f.mem_info().is_err()).count())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(failures, 1);
    assert_eq!(f.calls(Op::MemInfo), 1000);
}
