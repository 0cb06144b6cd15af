use super::pull::{Ptr, classify};
use super::*;
use crate::transport::ucx::MAX_GET_BYTES;

#[test]
fn status_pointers_classify_like_ucs_ptr_is_err() {
    assert!(matches!(classify(std::ptr::null_mut()), Ptr::Done));
    assert!(matches!(
        classify(UCS_ERR_CANCELED as isize as *mut c_void),
        Ptr::Error(UCS_ERR_CANCELED)
    ));
    assert!(matches!(classify(0x1000 as *mut c_void), Ptr::Request(_)));
    assert!(matches!(
        classify(-200isize as *mut c_void),
        Ptr::Request(_)
    ));
}

#[test]
fn shared_memory_follows_ucx_tls() {
    assert!(shm_in(None));
    assert!(shm_in(Some("all")));
    assert!(shm_in(Some("shm,cma,self")));
    assert!(shm_in(Some("^tcp")));
    assert!(!shm_in(Some("tcp")));
    assert!(!shm_in(Some("^shm")));
}

#[test]
fn long_segments_are_cut() {
    let s = split(&[Segment {
        remote: 10,
        local: 20,
        len: 2 * MAX_GET_BYTES + 1,
    }]);
    assert_eq!(s.len(), 3);
    assert_eq!(s[2].remote, 10 + 2 * MAX_GET_BYTES);
    assert_eq!(s[2].len, 1);
}
