//! Peer access: another GPU reads and writes a pool's memory.
//!
//! A pool on GPU 0 gives GPU 1 read-write access (`MemPool::set_access`);
//! a kernel on GPU 1 writes a tag into a pool allocation and a kernel on
//! GPU 0 verifies it; the access is read back from the driver, revoked and
//! read back again.
//!
//! ```text
//! cargo run --release --example peer
//! ```
//! With fewer than two GPUs (or no driver) it shows the typed error a pool
//! gives for a peer that does not exist, on the host backend, and exits 0.

use std::sync::Arc;
use tidepool::{MemPool, PoolConfig};
use tidepool_kernels::{cuda::CudaKernels, TagKernels};
use tidepool_sys::cuda::{driver_available, CudaDevice};
use tidepool_sys::{Access, Device, HostDevice};

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    let two = driver_available()
        && CudaDevice::new(0)
            .and_then(|d| d.device_count())
            .map(|n| n >= 2)
            .unwrap_or(false);
    if !two {
        let dev = Arc::new(HostDevice::new());
        let err = MemPool::new(dev, PoolConfig::default().with_peer_devices(vec![1]))
            .expect_err("the host backend has one device");
        println!("{{\"example\":\"peer\",\"devices\":\"fewer than 2\",\"typed_error\":\"{err}\"}}");
        return Ok(());
    }
    let (d0, d1) = (Arc::new(CudaDevice::new(0)?), Arc::new(CudaDevice::new(1)?));
    if !d0.can_access_peer(1)? {
        println!("{{\"example\":\"peer\",\"devices\":2,\"peer_path\":false}}");
        return Ok(());
    }
    let pool = MemPool::new(d0.clone(), PoolConfig::default())?;
    pool.set_access(1, Access::ReadWrite)?;
    let (s0, s1) = (d0.create_stream()?, d1.create_stream()?);
    let (k0, k1) = (CudaKernels::new(d0.clone())?, CudaKernels::new(d1.clone())?);
    let len = 64 << 20;
    let buf = pool.alloc_async(len, s0)?;
    d0.synchronize_stream(s0)?;
    k1.fill_tag(s1, buf.ptr(), len, 0xfeed)?;
    d1.synchronize_stream(s1)?;
    k0.verify_tag(s0, buf.ptr(), len, 0xfeed)?;
    let mismatches = k0.mismatches()?;
    let granted = pool.access(1)?;
    pool.set_access(1, Access::None)?;
    let revoked = pool.access(1)?;
    pool.free_async(buf, s0)?;
    pool.synchronize()?;
    println!(
        "{{\"example\":\"peer\",\"devices\":2,\"bytes\":{len},\"mismatches\":{mismatches},\"access_granted\":\"{granted:?}\",\"access_revoked\":\"{revoked:?}\"}}"
    );
    if mismatches > 0 {
        return Err("GPU 0 saw words GPU 1 did not write".into());
    }
    Ok(())
}
