//! Each host physical handle is a file descriptor. This binary holds one
//! test only, because it changes the process's RLIMIT_NOFILE.

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{Device, Op, PhysicalOptions, SysError};

#[test]
fn fd_limit_is_raised_and_running_out_is_a_clear_error() {
    let hard = getrlimit(Resource::Nofile).maximum;
    // Start from the common default soft limit of 1,024.
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(hard.map_or(1024, |h| h.min(1024))),
            maximum: hard,
        },
    )
    .unwrap();
    let g = 64 * 1024;
    let d = HostDevice::with_config(HostConfig {
        capacity: 1 << 30,
        granularity: g,
    });
    assert_eq!(
        getrlimit(Resource::Nofile).current,
        hard,
        "construction raises the soft limit to the hard limit"
    );
    let mut handles = Vec::new();
    if hard.is_none_or(|h| h >= 4096) {
        // More handles than the old soft limit allowed.
        for _ in 0..2000 {
            handles.push(d.create_physical(g, PhysicalOptions::default()).unwrap());
        }
    }
    // Now lower the soft limit just above what is open: running out of file
    // descriptors is an Os error that says what happened, not a crash.
    let open = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(open + 8),
            maximum: hard,
        },
    )
    .unwrap();
    let err = loop {
        match d.create_physical(g, PhysicalOptions::default()) {
            Ok(h) => handles.push(h),
            Err(e) => break e,
        }
        assert!(handles.len() < 100_000, "never ran out of fds");
    };
    match &err {
        SysError::Os {
            op: Op::CreatePhysical,
            errno,
            message,
        } => {
            assert_eq!(*errno, 24, "EMFILE");
            assert!(message.contains("file descriptors"), "{message}");
        }
        other => panic!("expected an Os error, got {other:?}"),
    }
    // The failed creation took no capacity.
    let used = handles.len() * g;
    assert_eq!(d.mem_info().unwrap().free, (1 << 30) - used);
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: hard,
            maximum: hard,
        },
    )
    .unwrap();
    for h in handles {
        d.release_physical(h).unwrap();
    }
    assert_eq!(d.mem_info().unwrap().free, 1 << 30);
}
