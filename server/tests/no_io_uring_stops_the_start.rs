//! A kernel that refuses io_uring (a container runtime's seccomp profile, or the sysctl
//! `kernel.io_uring_disabled`) stops the start at once with one error naming io_uring and
//! what it needs, instead of a shard's executor panicking and the start waiting for it.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// `io_uring_setup`'s number, the same on every architecture (it came after they were unified).
const IO_URING_SETUP: u32 = 425;
// Classic BPF and seccomp, as linux/filter.h and linux/seccomp.h define them: BPF_LD|BPF_W|
// BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K.
const BPF_LD_W_ABS: u16 = 0x20;
const BPF_JMP_JEQ_K: u16 = 0x15;
const BPF_RET_K: u16 = 0x06;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_MODE_FILTER: libc::c_ulong = 2;

/// Installs, in the calling process, a seccomp filter under which `io_uring_setup` fails with
/// EPERM and every other system call is allowed (what Docker's default profile does).
fn refuse_io_uring() -> std::io::Result<()> {
    let filter = [
        // The system call's number (offset 0 of struct seccomp_data).
        libc::sock_filter { code: BPF_LD_W_ABS, jt: 0, jf: 0, k: 0 },
        libc::sock_filter { code: BPF_JMP_JEQ_K, jt: 0, jf: 1, k: IO_URING_SETUP },
        libc::sock_filter {
            code: BPF_RET_K,
            jt: 0,
            jf: 0,
            k: SECCOMP_RET_ERRNO | libc::EPERM as u32,
        },
        libc::sock_filter { code: BPF_RET_K, jt: 0, jf: 0, k: SECCOMP_RET_ALLOW },
    ];
    let prog = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr().cast_mut() };
    // SAFETY: prctl with these options reads only `prog`, which outlives the call; the filter
    // applies to this (the forked child's) process only.
    let rc = unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            -1
        } else {
            libc::prctl(libc::PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog as *const libc::sock_fprog)
        }
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[test]
fn a_kernel_refusing_io_uring_stops_the_start_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let mut cmd = Command::new(orbitkv_testkit::server_bin());
    cmd.arg("--socket").arg(&socket).args(["--dram", "16MiB", "--shards", "1", "--no-lock-arena"]);
    // SAFETY: the closure runs in the forked child before exec and only calls prctl.
    unsafe { cmd.pre_exec(refuse_io_uring) };
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("io_uring is not available"), "{stderr}");
    assert!(stderr.contains("Linux 5.8"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!socket.exists(), "nothing was bound");
}
