//! A real etcd (Debian's `etcd-server`; `.ci/run` installs it) on loopback ports, in a
//! temporary data directory, for the cluster-mode tests.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Etcd {
    child: Child,
    pub dir: tempfile::TempDir,
    /// The client endpoint, `http://127.0.0.1:PORT`.
    pub url: String,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Etcd {
    /// Starts etcd and waits until it answers.
    pub fn start() -> Etcd {
        let bin = std::env::var("ORBITKV_TEST_ETCD").unwrap_or_else(|_| "etcd".into());
        let dir = tempfile::Builder::new().prefix("okv-etcd").tempdir_in("/tmp").unwrap();
        let (client, peer) = (free_port(), free_port());
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(dir.path().join("etcd.log")).unwrap();
        let child = Command::new(&bin)
            .args(["--name", "t", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("t={peer_url}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {bin} ({e}): install etcd (Debian: apt install etcd-server)")
            });
        let etcd = Etcd { child, dir, url };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", client)).is_err() {
            assert!(Instant::now() < deadline, "etcd did not listen: {}", etcd.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        etcd
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }

    /// The server flags of a member of cluster `cluster` with id `node`, its peer address on
    /// loopback port `port`, and a 2 s lease TTL (a dead member leaves within it).
    pub fn member_args(&self, cluster: &str, node: &str, port: u16) -> Vec<String> {
        ["--etcd", &self.url, "--cluster", cluster, "--node-id", node]
            .into_iter()
            .map(String::from)
            .chain(["--peer-addr".into(), format!("127.0.0.1:{port}")])
            .chain(["--cluster-lease-ttl".into(), "2s".into()])
            // A Transfer Engine build's C API library, where the tester has one.
            .chain(
                std::env::var("ORBITKV_TE_LIBRARY")
                    .into_iter()
                    .flat_map(|lib| ["--te-library".to_owned(), lib]),
            )
            .collect()
    }

    /// SIGSTOP: etcd stops answering (its connections stay open, as with a network
    /// partition); `resume` lets it go on.
    pub fn pause(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    pub fn resume(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.resume();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
