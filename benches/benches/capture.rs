//! Captured CUDA graphs with allocations: a graph that allocates `NODES`
//! blocks of 64 KiB, fills each with a tag, and frees them (each free after
//! the next block's allocation, so two blocks are live at a time), captured
//! once and launched again and again.
//!
//! Two measurements per allocator:
//! - `replay`: one op = one launch of the executable graph plus a wait for
//!   it (the time a replay of the graph takes, memory nodes included);
//! - `capture`: one op = one capture of the graph (begin, the allocations,
//!   fills and frees, end), the graph destroyed untimed.
//!
//! Allocators: tidepool (`MemPool::alloc_async`/`free_async` on the
//! capturing stream, strict mode: each call asks for the stream's capture
//! status, then records a graph memory node) and, on CUDA, the driver's own
//! stream-ordered allocator called directly on the capturing stream
//! (`cuMemAllocAsync`/`cuMemFreeAsync`, `driver-graph`). The host backend
//! runs the tidepool side only (its graph memory is the host backend's
//! simulation, so its figures say nothing about the GPU).

use criterion::{criterion_group, criterion_main, Criterion};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tidepool::MemPool;
mod benchutil;
use benchutil::{self as bu, Meas};
use tidepool_kernels::{TagKernels, WithTagKernels};
use tidepool_sys::{CaptureMode, Device, DevicePtr, GraphOptions, Stream};

const SIZE: usize = 64 << 10;
const NODES: usize = 8;

/// How a graph's memory nodes are made.
trait GraphAlloc {
    fn name(&self) -> &'static str;
    /// Record the allocations, fills and frees on the capturing `stream`.
    fn record(&self, k: &dyn TagKernels, stream: Stream);
}

struct PoolNodes<D: Device>(MemPool<D>);

impl<D: Device> GraphAlloc for PoolNodes<D> {
    fn name(&self) -> &'static str {
        "tidepool"
    }
    fn record(&self, k: &dyn TagKernels, s: Stream) {
        let mut prev = None;
        for i in 0..NODES {
            let a = self.0.alloc_async(SIZE, s).expect("alloc_async in capture");
            assert!(a.is_graph_memory());
            k.fill_tag(s, a.ptr(), SIZE, i as u32).expect("fill");
            if let Some(p) = prev.replace(a) {
                self.0.free_async(p, s).expect("free_async in capture");
            }
        }
        if let Some(p) = prev {
            self.0.free_async(p, s).expect("free_async in capture");
        }
    }
}

struct DriverNodes<D: Device>(Arc<D>);

impl<D: Device> GraphAlloc for DriverNodes<D> {
    fn name(&self) -> &'static str {
        "driver-graph"
    }
    fn record(&self, k: &dyn TagKernels, s: Stream) {
        let mut prev: Option<DevicePtr> = None;
        for i in 0..NODES {
            let a = self
                .0
                .graph_alloc(s, SIZE)
                .expect("cuMemAllocAsync in capture");
            k.fill_tag(s, a, SIZE, i as u32).expect("fill");
            if let Some(p) = prev.replace(a) {
                self.0.graph_free(s, p).expect("cuMemFreeAsync in capture");
            }
        }
        if let Some(p) = prev {
            self.0.graph_free(s, p).expect("cuMemFreeAsync in capture");
        }
    }
}

fn run<D: Device>(g: &mut bu::Group<'_>, dev: &Arc<D>, k: &dyn TagKernels, h: &dyn GraphAlloc) {
    let backend = dev.backend_name();
    let cap = dev.create_stream().expect("stream");
    let launch = dev.create_stream().expect("stream");
    let param = format!("{NODES}x{}", bu::size_label(SIZE));

    let m = Meas {
        bench: "capture",
        backend,
        allocator: h.name(),
        param: format!("capture/{param}"),
        ops_per_iter: 1,
    };
    bu::bench(g, &m, |iters| {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let start = Instant::now();
            dev.begin_capture(cap, CaptureMode::Global)
                .expect("begin capture");
            h.record(k, cap);
            let graph = dev.end_capture(cap).expect("end capture");
            total += start.elapsed();
            dev.destroy_graph(graph).expect("destroy graph");
        }
        total
    });

    dev.begin_capture(cap, CaptureMode::Global)
        .expect("begin capture");
    h.record(k, cap);
    let graph = dev.end_capture(cap).expect("end capture");
    let exec = dev
        .instantiate_graph(graph, GraphOptions::default())
        .expect("instantiate");
    let m = Meas {
        bench: "capture",
        backend,
        allocator: h.name(),
        param: format!("replay/{param}"),
        ops_per_iter: 1,
    };
    bu::bench(g, &m, |iters| {
        bu::time_loop(iters, || {
            dev.launch_graph(exec, launch).expect("launch graph");
            dev.synchronize_stream(launch).expect("sync");
        })
    });
    dev.destroy_graph_exec(exec).expect("destroy exec");
    dev.destroy_graph(graph).expect("destroy graph");
    let _ = dev.destroy_stream(cap);
    let _ = dev.destroy_stream(launch);
}

fn benches(c: &mut Criterion) {
    bu::Summary::meta("capture");
    let mut g = bu::group(c, "capture", false);
    let host = bu::host_device();
    let k = host.clone().tag_kernels().expect("host kernels");
    let pool = bu::Tidepool::new(host.clone()).pool;
    run(&mut g, &host, &*k, &PoolNodes(pool));
    if let Some(dev) = bu::cuda_or_skip("capture (cuda)") {
        let k = dev.clone().tag_kernels().expect("cuda kernels");
        let pool = bu::Tidepool::new(dev.clone()).pool;
        run(&mut g, &dev, &*k, &PoolNodes(pool));
        run(&mut g, &dev, &*k, &DriverNodes(dev.clone()));
    }
    g.finish();
}

criterion_group! {
    name = group;
    config = bu::criterion();
    targets = benches
}
criterion_main!(group);
