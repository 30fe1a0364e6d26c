//! Interprocess plumbing: passing bytes and file descriptors over a Unix
//! socket (`SCM_RIGHTS`), and a few 64-bit words of memory shared between
//! processes (a memfd mapped in each of them).
//!
//! The socket helper frames one message as a 16-byte header (magic, payload
//! length, number of descriptors), the payload, and the descriptors, which
//! travel in chunks of at most [`FDS_PER_CHUNK`] (the kernel takes at most
//! 253 per `sendmsg`): the first chunk with the header, each further chunk
//! with one filler byte. [`recv_message`] reads exactly the bytes of one
//! message, so several messages may follow each other on one stream socket.

use crate::error::{Op, SysError, SysResult};
use crate::validate::invalid;
use rustix::io::Errno;
use rustix::mm::{MapFlags, ProtFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use std::ffi::c_void;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

/// Descriptors sent with one `sendmsg` call.
pub const FDS_PER_CHUNK: usize = 250;

/// Largest payload [`recv_message`] accepts (a guard against a peer that
/// speaks another protocol).
pub const MAX_PAYLOAD: usize = 16 << 20;

/// Largest number of descriptors [`recv_message`] accepts.
pub const MAX_FDS: usize = 1 << 16;

const MAGIC: u32 = 0x5450_4d31; // "TPM1"
const HEADER: usize = 16;
const FILLER: u8 = 0xfd;
/// Seals a shared-words file must carry: its size cannot change.
const REQUIRED_SEALS: rustix::fs::SealFlags =
    rustix::fs::SealFlags::SHRINK.union(rustix::fs::SealFlags::GROW);

fn os(e: Errno, what: &str) -> SysError {
    SysError::Os {
        op: Op::Ipc,
        errno: e.raw_os_error(),
        message: format!("{what}: {e}"),
    }
}

/// Send `payload` and `fds` as one message over a connected Unix stream
/// socket. The descriptors stay open here (the receiver gets duplicates).
pub fn send_message(sock: impl AsFd, payload: &[u8], fds: &[BorrowedFd<'_>]) -> SysResult<()> {
    let sock = sock.as_fd();
    if payload.len() > MAX_PAYLOAD || fds.len() > MAX_FDS {
        return Err(invalid(
            Op::Ipc,
            format!(
                "message too large: {} bytes (at most {MAX_PAYLOAD}), {} descriptors (at most {MAX_FDS})",
                payload.len(),
                fds.len()
            ),
        ));
    }
    let mut header = [0u8; HEADER];
    header[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    header[4..8].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    header[8..12].copy_from_slice(&(fds.len() as u32).to_le_bytes());
    let mut chunks = fds.chunks(FDS_PER_CHUNK);
    send_part(sock, &[&header, payload], chunks.next().unwrap_or(&[]))?;
    for chunk in chunks {
        send_part(sock, &[&[FILLER]], chunk)?;
    }
    Ok(())
}

/// One `sendmsg` with `fds` attached, then plain writes for what it did
/// not take (the descriptors go with the first byte).
fn send_part(sock: BorrowedFd<'_>, parts: &[&[u8]], fds: &[BorrowedFd<'_>]) -> SysResult<()> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut space =
        vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_CHUNK))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(invalid(Op::Ipc, "too many descriptors for one chunk"));
    }
    let iov: Vec<IoSlice<'_>> = parts.iter().map(|p| IoSlice::new(p)).collect();
    let sent = loop {
        match rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL) {
            Ok(n) => break n,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(os(e, "sendmsg")),
        }
    };
    let flat: Vec<u8> = parts.concat();
    let mut done = sent;
    while done < total {
        match rustix::net::send(sock, &flat[done..], SendFlags::NOSIGNAL) {
            Ok(0) => return Err(invalid(Op::Ipc, "the peer closed the socket")),
            Ok(n) => done += n,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(os(e, "send")),
        }
    }
    Ok(())
}

/// Receive one message sent by [`send_message`]: its payload and its
/// descriptors (close-on-exec), in the order they were sent.
pub fn recv_message(sock: impl AsFd) -> SysResult<(Vec<u8>, Vec<OwnedFd>)> {
    let sock = sock.as_fd();
    let mut fds = Vec::new();
    let mut header = [0u8; HEADER];
    recv_exact(sock, &mut header, &mut fds)?;
    let magic = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
    if magic != MAGIC {
        return Err(invalid(
            Op::Ipc,
            format!("not a tidepool message (magic {magic:#x})"),
        ));
    }
    let len = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes")) as usize;
    let nfds = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")) as usize;
    if len > MAX_PAYLOAD || nfds > MAX_FDS {
        return Err(invalid(
            Op::Ipc,
            format!("message too large: {len} bytes, {nfds} descriptors"),
        ));
    }
    let mut payload = vec![0u8; len];
    recv_exact(sock, &mut payload, &mut fds)?;
    for _ in 1..nfds.div_ceil(FDS_PER_CHUNK) {
        let mut filler = [0u8; 1];
        recv_exact(sock, &mut filler, &mut fds)?;
    }
    if fds.len() != nfds {
        return Err(invalid(
            Op::Ipc,
            format!("{} descriptors arrived, {nfds} were sent", fds.len()),
        ));
    }
    Ok((payload, fds))
}

fn recv_exact(sock: BorrowedFd<'_>, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> SysResult<()> {
    let mut got = 0;
    while got < buf.len() {
        let mut space =
            vec![MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_CHUNK + 3))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(&mut buf[got..])];
        let msg = match rustix::net::recvmsg(sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)
        {
            Ok(m) => m,
            Err(Errno::INTR) => continue,
            Err(e) => return Err(os(e, "recvmsg")),
        };
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = m {
                fds.extend(received);
            }
        }
        if msg.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
            return Err(invalid(
                Op::Ipc,
                "descriptors were dropped by the kernel (control buffer too small)",
            ));
        }
        if msg.bytes == 0 {
            return Err(invalid(
                Op::Ipc,
                "the peer closed the socket in the middle of a message",
            ));
        }
        got += msg.bytes;
    }
    Ok(())
}

/// A few 64-bit words of memory shared between processes: a memfd mapped
/// read-write in each process that holds it. Every access is atomic, so the
/// words may serve as counters and flags across processes. The memfd is
/// sealed against shrinking and growing, and [`SharedWords::open`] accepts
/// nothing else: a file that its sender could shrink under the mapping
/// would make the next access fail with SIGBUS.
pub struct SharedWords {
    fd: OwnedFd,
    ptr: NonNull<AtomicU64>,
    words: usize,
    bytes: usize,
}

// SAFETY: the mapping is only reached through `&AtomicU64`, which is Sync;
// the pointer stays valid until drop.
unsafe impl Send for SharedWords {}
// SAFETY: as above.
unsafe impl Sync for SharedWords {}

impl std::fmt::Debug for SharedWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWords")
            .field("words", &self.words)
            .finish_non_exhaustive()
    }
}

impl SharedWords {
    /// Fresh words, all zero.
    pub fn create(words: usize) -> SysResult<SharedWords> {
        if words == 0 {
            return Err(invalid(Op::Ipc, "zero shared words"));
        }
        let fd = rustix::fs::memfd_create(
            "tidepool-shared",
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| os(e, "memfd_create"))?;
        let bytes = (words * 8).next_multiple_of(rustix::param::page_size());
        rustix::fs::ftruncate(&fd, bytes as u64).map_err(|e| os(e, "ftruncate"))?;
        rustix::fs::fcntl_add_seals(&fd, REQUIRED_SEALS | rustix::fs::SealFlags::SEAL)
            .map_err(|e| os(e, "sealing the shared words"))?;
        Self::map(fd, words, bytes)
    }

    /// Open words another process created (its [`SharedWords::share`]);
    /// the file must hold at least `words` words and be sealed against
    /// changes of size (any other descriptor is refused).
    pub fn open(fd: OwnedFd, words: usize) -> SysResult<SharedWords> {
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| {
            invalid(
                Op::Ipc,
                format!("not shared words made by SharedWords::create (no seals: {e})"),
            )
        })?;
        if !seals.contains(REQUIRED_SEALS) {
            return Err(invalid(
                Op::Ipc,
                "not shared words made by SharedWords::create (its size is not sealed)",
            ));
        }
        let st = rustix::fs::fstat(&fd).map_err(|e| os(e, "fstat"))?;
        let bytes = usize::try_from(st.st_size).unwrap_or(0);
        if words == 0 || bytes < words * 8 || bytes % rustix::param::page_size() != 0 {
            return Err(invalid(
                Op::Ipc,
                format!("the descriptor holds {bytes} bytes, not {words} shared words"),
            ));
        }
        Self::map(fd, words, bytes)
    }

    fn map(fd: OwnedFd, words: usize, bytes: usize) -> SysResult<SharedWords> {
        // SAFETY: a fresh shared mapping of the whole file (whose size is
        // `bytes`, a multiple of the page size) at an address the kernel
        // picks: it replaces nothing, and it cannot SIGBUS because the file
        // keeps its size (sealed against shrinking: made so by `create`,
        // checked by `open`).
        let p = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                bytes,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        }
        .map_err(|e| os(e, "mmap"))?;
        let ptr = NonNull::new(p.cast::<AtomicU64>())
            .ok_or_else(|| invalid(Op::Ipc, "mmap returned null"))?;
        Ok(SharedWords {
            fd,
            ptr,
            words,
            bytes,
        })
    }

    /// Word `i`.
    ///
    /// # Panics
    /// If `i` is out of range.
    pub fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.words, "shared word {i} of {}", self.words);
        // SAFETY: `i` is in range; the mapping is page-aligned (so 8-aligned),
        // lives until `self` drops, and is only accessed atomically (in
        // every process, all through this type); any bit pattern is a valid
        // u64.
        unsafe { &*self.ptr.as_ptr().add(i) }
    }

    /// Number of words.
    pub fn len(&self) -> usize {
        self.words
    }

    /// Always false (there is at least one word).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// A new descriptor of the same memory, to send to another process.
    pub fn share(&self) -> SysResult<OwnedFd> {
        rustix::io::fcntl_dupfd_cloexec(&self.fd, 0).map_err(|e| os(e, "dup"))
    }

    /// The descriptor (for sending it without duplicating it first).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for SharedWords {
    fn drop(&mut self) {
        let (ptr, len) = (self.ptr.as_ptr().cast::<c_void>(), self.bytes);
        // SAFETY: exactly the mapping made in `map`; references handed out
        // by `word` borrow `self`, so none outlives this.
        let r = unsafe { rustix::mm::munmap(ptr, len) };
        if let Err(e) = r {
            tracing::warn!(error = %e, "unmapping shared words failed");
        }
    }
}
