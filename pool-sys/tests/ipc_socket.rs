//! The socket helper and shared words: descriptors arrive in order, in
//! chunks beyond one `sendmsg`'s limit, and messages do not run together.

use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use tidepool_sys::ipc::{recv_message, send_message, SharedWords, FDS_PER_CHUNK};

#[test]
fn many_descriptors_arrive_in_order_and_messages_stay_apart() {
    let (a, b) = UnixStream::pair().unwrap();
    // More descriptors than fit in two chunks, each a distinct shared word.
    let n = 2 * FDS_PER_CHUNK + 17;
    let words: Vec<SharedWords> = (0..n).map(|_| SharedWords::create(1).unwrap()).collect();
    for (i, w) in words.iter().enumerate() {
        w.word(0).store(1000 + i as u64, Ordering::Release);
    }
    let fds: Vec<BorrowedFd<'_>> = words.iter().map(|w| w.fd()).collect();
    send_message(&a, b"first", &[]).unwrap();
    let (p1, f1) = recv_message(&b).unwrap();
    assert_eq!(p1, b"first");
    assert!(f1.is_empty());
    // The big message, then a small one right behind it.
    let big = std::thread::scope(|sc| {
        sc.spawn(|| {
            send_message(&a, &[9u8; 100_000], &fds).unwrap();
            send_message(&a, b"second", &[]).unwrap();
        });
        recv_message(&b).unwrap()
    });
    let (payload, got) = big;
    assert_eq!(payload.len(), 100_000);
    assert!(payload.iter().all(|&x| x == 9));
    assert_eq!(got.len(), n);
    for (i, fd) in got.into_iter().enumerate() {
        let w = SharedWords::open(fd, 1).unwrap();
        assert_eq!(
            w.word(0).load(Ordering::Acquire),
            1000 + i as u64,
            "descriptor {i}"
        );
        // Shared, not copied: a store through the received one is seen here.
        w.word(0).store(7, Ordering::Release);
        assert_eq!(words[i].word(0).load(Ordering::Acquire), 7);
    }
    let (p2, f2) = recv_message(&b).unwrap();
    assert_eq!(p2, b"second");
    assert!(f2.is_empty());
}

#[test]
fn a_closed_peer_and_garbage_are_errors() {
    let (a, b) = UnixStream::pair().unwrap();
    use std::io::Write;
    (&a).write_all(&[0u8; 16]).unwrap();
    assert!(recv_message(&b).is_err(), "bad magic");
    drop(a);
    assert!(recv_message(&b).is_err(), "closed");
    let _ = b.as_fd();
}

#[test]
fn shared_words_check_their_size() {
    let w = SharedWords::create(2).unwrap();
    assert_eq!(w.len(), 2);
    let fd = w.share().unwrap();
    // A page holds 512 words; asking for more than the file holds fails.
    assert!(SharedWords::open(fd, 100_000).is_err());
}
