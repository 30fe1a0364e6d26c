//! The tag kernels on the host backend.
#![forbid(unsafe_code)]

mod common;

use std::sync::Arc;

use tidepool_kernels::host::HostKernels;
use tidepool_kernels::{kernels_for_host, TagKernels, WithTagKernels};
use tidepool_sys::{Device, HostConfig, HostDevice};

fn device() -> Arc<HostDevice> {
    Arc::new(HostDevice::with_config(HostConfig {
        capacity: 1 << 30,
        granularity: 2 << 20,
    }))
}

#[test]
fn fill_then_verify() {
    let dev = device();
    let k = kernels_for_host(dev.clone());
    assert_eq!(k.backend_name(), "host");
    common::fill_verify_roundtrip(&*dev, &*k);
}

#[test]
fn rejects_unaligned() {
    let dev = device();
    common::rejects_unaligned(&*dev, &HostKernels::new(dev.clone()));
}

#[test]
fn spin_orders_later_work() {
    let dev = device();
    common::spin_orders_later_work(&*dev, &HostKernels::new(dev.clone()));
}

#[test]
fn streams_do_not_wait_for_each_other() {
    let dev = device();
    common::streams_do_not_wait_for_each_other(&*dev, &HostKernels::new(dev.clone()));
}

#[test]
fn spin_takes_its_time() {
    let dev = device();
    common::spin_takes_its_time(&*dev, &HostKernels::new(dev.clone()));
}

#[test]
fn fill_matches_tag_word() {
    let dev = device();
    let k = HostKernels::new(dev.clone());
    common::fill_matches_tag_word(&*dev, &k, &|ptr, n| dev.read_words(ptr, n).unwrap());
}

#[test]
fn threads_on_streams() {
    let dev = device();
    let k = dev.clone().tag_kernels().unwrap();
    common::threads_on_streams(&*dev, &*k);
}

/// A host twin touching an unmapped range, or a mapped one without access,
/// counts an access fault and `len / 4` mismatches (verify) instead of
/// crashing; a faulting fill counts an access fault only.
#[test]
fn unmapped_range_counts_an_access_fault() {
    let dev = device();
    let k = HostKernels::new(dev.clone());
    // Two granules reserved, the first mapped read-write, the second not.
    let m = common::Mapping::new(&*dev, 2, 1, true);
    let g = m.granule;
    let s = dev.create_stream().unwrap();
    let unmapped = m.ptr + g as u64;

    k.verify_tag(s, unmapped, 4096, 1).unwrap();
    assert_eq!(k.access_faults().unwrap(), 1);
    assert_eq!(k.mismatches().unwrap(), 1024);

    // Straddling the end of the mapping faults as a whole.
    k.reset_counters().unwrap();
    k.fill_tag(s, unmapped - 8, 16, 1).unwrap();
    assert_eq!(k.access_faults().unwrap(), 1);
    assert_eq!(
        k.mismatches().unwrap(),
        0,
        "a faulting fill counts no mismatches"
    );

    // The mapped granule is unaffected.
    k.reset_counters().unwrap();
    k.fill_tag(s, m.ptr, g, 3).unwrap();
    k.verify_tag(s, m.ptr, g, 3).unwrap();
    assert_eq!(k.mismatches().unwrap(), 0);
    assert_eq!(k.access_faults().unwrap(), 0);
    dev.destroy_stream(s).unwrap();
}

#[test]
fn mapped_without_access_counts_an_access_fault() {
    let dev = device();
    let k = HostKernels::new(dev.clone());
    let m = common::Mapping::new(&*dev, 1, 1, false);
    let s = dev.create_stream().unwrap();
    k.verify_tag(s, m.ptr, 64, 1).unwrap();
    assert_eq!(k.access_faults().unwrap(), 1);
    assert_eq!(k.mismatches().unwrap(), 16);
    dev.destroy_stream(s).unwrap();
}

/// A verify enqueued behind a long spin is waited for by `mismatches()`.
#[test]
fn mismatches_waits_for_queued_verifies() {
    let dev = device();
    let k = HostKernels::new(dev.clone());
    let m = common::Mapping::new(&*dev, 1, 1, true);
    let s = dev.create_stream().unwrap();
    k.fill_tag(s, m.ptr, 4096, 1).unwrap();
    k.spin(s, 100_000_000).unwrap();
    k.verify_tag(s, m.ptr, 4096, 2).unwrap();
    assert_eq!(k.mismatches().unwrap(), 1024);
    dev.destroy_stream(s).unwrap();
}

/// Enqueueing on a stream that does not exist is a device error.
#[test]
fn bad_stream_is_a_device_error() {
    let dev = device();
    let k = HostKernels::new(dev.clone());
    let s = dev.create_stream().unwrap();
    dev.destroy_stream(s).unwrap();
    let err = k.fill_tag(s, 0x1000, 4, 1).unwrap_err();
    assert!(
        matches!(err, tidepool_kernels::KernelError::Device { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("fill_tag"), "{err}");
    // The refused task is not left pending.
    assert_eq!(k.mismatches().unwrap(), 0);
}

#[test]
fn captured_graph_replays_100_times() {
    let dev = device();
    let k = HostKernels::new(dev.clone());
    let faults_dev = dev.clone();
    common::captured_graph_replays(&*dev, &k, 100, &move || faults_dev.graph_faults());
    assert_eq!(dev.live_graph_allocations(), 0);
}

/// Work that the graph orders after its free node finds the memory
/// unmapped in every launch: the host backend makes a use after a graph's
/// free visible, where the GPU would silently read whatever is there.
#[test]
fn use_after_the_graphs_free_faults_in_every_launch() {
    use tidepool_sys::{CaptureMode, GraphOptions};
    let dev = device();
    let k = HostKernels::new(dev.clone());
    let (cap, run) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    let p = dev.graph_alloc(cap, 4096).unwrap();
    k.fill_tag(cap, p, 4096, 5).unwrap();
    dev.graph_free(cap, p).unwrap();
    k.verify_tag(cap, p, 4096, 5).unwrap();
    let g = dev.end_capture(cap).unwrap();
    let exec = dev.instantiate_graph(g, GraphOptions::default()).unwrap();
    for launch in 1..=10u64 {
        dev.launch_graph(exec, run).unwrap();
        dev.synchronize_stream(run).unwrap();
        assert_eq!(k.access_faults().unwrap(), launch);
        assert_eq!(k.mismatches().unwrap(), launch * 1024);
    }
    assert_eq!(dev.graph_faults(), 0);
    dev.destroy_graph_exec(exec).unwrap();
    dev.destroy_graph(g).unwrap();
}
