//! Shared words opened from a descriptor another process sent: only the
//! sealed memory files that `SharedWords::create` makes are accepted, so
//! that nobody can shrink the file under the mapping (which would kill the
//! reader with SIGBUS).

use std::os::fd::OwnedFd;
use tidepool_sys::ipc::SharedWords;

fn regular_file(bytes: u64) -> (std::fs::File, OwnedFd) {
    let path = std::env::temp_dir().join(format!(
        "tidepool-words-attack-{}-{bytes}",
        std::process::id()
    ));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("temp file");
    f.set_len(bytes).expect("size");
    let _ = std::fs::remove_file(&path);
    let other = f.try_clone().expect("dup");
    (other, f.into())
}

#[test]
fn a_file_that_can_shrink_is_refused() {
    let (keep, fd) = regular_file(4096);
    match SharedWords::open(fd, 2) {
        Err(_) => {}
        Ok(w) => {
            // What the refusal prevents: the sender shrinks the file, and
            // the next read of the words would be SIGBUS.
            keep.set_len(0).expect("shrink");
            let _ = w.len();
            panic!("a regular file that its sender can shrink was opened as shared words");
        }
    }
}

#[test]
fn shared_words_made_here_open_elsewhere_and_cannot_shrink() {
    let w = SharedWords::create(4).unwrap();
    w.word(3).store(42, std::sync::atomic::Ordering::Release);
    let fd = w.share().unwrap();
    let file = std::fs::File::from(fd.try_clone().unwrap());
    assert!(
        file.set_len(0).is_err(),
        "the file is sealed against shrinking"
    );
    let opened = SharedWords::open(fd, 4).unwrap();
    assert_eq!(
        opened.word(3).load(std::sync::atomic::Ordering::Acquire),
        42
    );
}
