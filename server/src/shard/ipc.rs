//! iceoryx2 setup: the per-server config (root path and shm prefix) and session services.

use std::path::Path;

use iceoryx2::port::server::Server;
use iceoryx2::prelude::*;
use iceoryx2::service::port_factory::request_response::PortFactory;

/// The iceoryx2 service flavour: ports stay on the shard thread that made them.
pub type IpcService = ipc::Service;
/// A session's request-response service.
pub type SessionService = PortFactory<IpcService, [u8], (), [u8], ()>;
/// The server port of a session.
pub type SessionServer = Server<IpcService, [u8], (), [u8], ()>;
/// One received request.
pub type ActiveRequest = iceoryx2::active_request::ActiveRequest<IpcService, [u8], (), [u8], ()>;

/// Root path and shm prefix of this server's iceoryx2 resources, derived from the socket path
/// so that servers on different sockets never see each other's services.
#[derive(Clone, Debug)]
pub struct IpcNames {
    /// Directory for iceoryx2's service and node files.
    pub root: String,
    /// Prefix of every `/dev/shm` object.
    pub prefix: String,
}

impl IpcNames {
    /// Names for the server listening on `socket`.
    pub fn for_socket(socket: &Path) -> Self {
        let hash = blake3::hash(socket.as_os_str().as_encoded_bytes());
        let tag: String = hash.as_bytes()[..6].iter().map(|b| format!("{b:02x}")).collect();
        let mut root = socket.as_os_str().to_string_lossy().into_owned();
        root.push_str(".iox/");
        Self { root, prefix: format!("okv{tag}_") }
    }
}

/// Why an iceoryx2 node, service or port could not be made: what was being made, its name,
/// and iceoryx2's own error (which has no `Display`, so it is kept as its debug text).
#[derive(Debug, thiserror::Error)]
#[error("iceoryx2 {what} {name:?}: {detail}")]
pub struct IpcError {
    /// What was being made (`root path`, `prefix`, `node`, `service`, `server port`, ...).
    pub what: &'static str,
    /// Its name.
    pub name: String,
    /// iceoryx2's error.
    pub detail: String,
}

impl IpcError {
    /// `what` named `name` failed with iceoryx2's error `e`.
    pub fn new(what: &'static str, name: &str, e: impl std::fmt::Debug) -> Self {
        Self { what, name: name.to_string(), detail: format!("{e:?}") }
    }
}

/// Builds the iceoryx2 config shared by the server and its clients.
pub fn config(names: &IpcNames) -> Result<Config, IpcError> {
    let mut c = Config::default();
    let root = iceoryx2::prelude::Path::new(names.root.as_bytes())
        .map_err(|e| IpcError::new("root path", &names.root, e))?;
    c.global.set_root_path(&root);
    c.global.prefix = FileName::new(names.prefix.as_bytes())
        .map_err(|e| IpcError::new("prefix", &names.prefix, e))?;
    Ok(c)
}

/// Creates a session's service and its server port. Lossless in both directions; one client.
pub fn create_session_service(
    node: &Node<IpcService>,
    service_name: &str,
    max_inflight: usize,
) -> Result<(SessionService, SessionServer), IpcError> {
    let name = ServiceName::new(service_name)
        .map_err(|e| IpcError::new("service name", service_name, e))?;
    let service = node
        .service_builder(&name)
        .request_response::<[u8], [u8]>()
        .enable_safe_overflow_for_requests(false)
        .enable_safe_overflow_for_responses(false)
        .enable_fire_and_forget_requests(false)
        .max_servers(1)
        .max_clients(1)
        .max_nodes(2)
        .max_active_requests_per_client(max_inflight)
        .max_loaned_requests(1)
        .max_response_buffer_size(1)
        .max_borrowed_responses_per_pending_response(1)
        .create()
        .map_err(|e| IpcError::new("service", service_name, e))?;
    let server = service
        .server_builder()
        .initial_max_slice_len(4096)
        .allocation_strategy(AllocationStrategy::PowerOfTwo)
        .max_loaned_responses_per_request(1)
        .create()
        .map_err(|e| IpcError::new("server port of", service_name, e))?;
    Ok((service, server))
}

/// Receives a session's next request, unless the `held` requests of it received and not yet
/// answered fill its `max_inflight`. The port holds at most that many (the service's
/// `max_active_requests_per_client`), and a receive while it holds them and more wait fails
/// with `ExceedsMaxBorrows`. A client can have more waiting: the transport stops counting a
/// started request the client drops (a cancelled transfer) while the server still runs it
/// (the Rust client goes on counting it until answered; another client need not). Those wait
/// in the port until an answer frees a place.
pub fn receive_within(
    server: &SessionServer,
    held: usize,
    max_inflight: usize,
) -> Result<Option<ActiveRequest>, iceoryx2::port::ReceiveError> {
    if held >= max_inflight {
        return Ok(None);
    }
    server.receive()
}

/// How often the janitor looks at `/dev/shm` with no session closing meanwhile.
const JANITOR_TICK: std::time::Duration = std::time::Duration::from_secs(2);

/// Age past which an empty shared memory object of this server's prefix is a leftover of a
/// client that died while creating it (creating one takes microseconds).
const EMPTY_IS_STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

/// Cleans up after clients that died (their iceoryx2 ports and shared memory) on threads of
/// its own. iceoryx2's dead-node cleanup can block: it waits, without a bound, for a shared
/// memory object that is still empty, which is what a client killed while creating one leaves
/// behind. No shard may wait on that, so shards only ask for a cleanup ([`Janitor::request`]).
/// A sweeper thread removes such empty objects once they are stale (which also ends such a
/// wait), and the cleaner thread runs iceoryx2's cleanup only while no empty one is left.
#[derive(Debug)]
pub struct Janitor {
    tx: crossbeam_channel::Sender<()>,
    /// Dropped with the janitor: the sweeper stops.
    _stop: crossbeam_channel::Sender<()>,
}

impl Janitor {
    /// Starts the janitor's threads for the server whose iceoryx2 names are `names`.
    pub fn spawn(names: IpcNames) -> std::io::Result<Self> {
        let (stop, stopped) = crossbeam_channel::bounded::<()>(0);
        let prefix = names.prefix.clone();
        std::thread::Builder::new().name("orbitkv-ipc-sweeper".into()).spawn(move || {
            let shm = Path::new("/dev/shm");
            while let Err(crossbeam_channel::RecvTimeoutError::Timeout) =
                stopped.recv_timeout(JANITOR_TICK)
            {
                remove_stale_empty_objects(shm, &prefix, EMPTY_IS_STALE_AFTER);
            }
        })?;
        let (tx, rx) = crossbeam_channel::bounded(1);
        std::thread::Builder::new().name("orbitkv-ipc-janitor".into()).spawn(move || {
            let node = match config(&names).and_then(|cfg| {
                NodeBuilder::new()
                    .config(&cfg)
                    .create::<IpcService>()
                    .map_err(|e| IpcError::new("node", "janitor", e))
            }) {
                Ok(node) => node,
                Err(e) => {
                    tracing::error!(error = %e, "iceoryx2 janitor not started: dead clients' ports stay until restart");
                    return;
                }
            };
            let mut pending = false;
            loop {
                match rx.recv_timeout(JANITOR_TICK) {
                    Ok(()) => pending = true,
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
                }
                if !pending {
                    continue;
                }
                let shm = Path::new("/dev/shm");
                if remove_stale_empty_objects(shm, &names.prefix, EMPTY_IS_STALE_AFTER) == 0 {
                    let cleanup = node.try_cleanup_dead_nodes();
                    tracing::debug!(?cleanup, "iceoryx2 dead-node cleanup");
                    pending = false;
                }
            }
        })?;
        Ok(Self { tx, _stop: stop })
    }

    /// Asks for a cleanup of dead clients' resources (a session closed); never blocks.
    pub fn request(&self) {
        let _ = self.tx.try_send(());
    }
}

/// Removes the empty objects of `prefix` in `dir` older than `stale` (each logged); returns how
/// many empty ones are younger (perhaps being created now).
pub fn remove_stale_empty_objects(dir: &Path, prefix: &str, stale: std::time::Duration) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    let mut young = 0;
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with(prefix) {
            continue;
        }
        let Ok(meta) = entry.metadata() else { continue };
        if meta.len() != 0 {
            continue;
        }
        let age = meta.modified().ok().and_then(|m| m.elapsed().ok()).unwrap_or_default();
        if age < stale {
            young += 1;
        } else if std::fs::remove_file(entry.path()).is_ok() {
            tracing::warn!(
                object = %entry.file_name().to_string_lossy(),
                age_s = age.as_secs(),
                "removed an empty iceoryx2 shared memory object: a client died while creating it"
            );
        }
    }
    young
}

/// Removes this server's leftover iceoryx2 files (after every node is dropped).
pub fn remove_leftovers(names: &IpcNames) {
    let _ = std::fs::remove_dir_all(&names.root);
    if let Ok(dir) = std::fs::read_dir("/dev/shm") {
        for entry in dir.flatten() {
            if entry.file_name().to_string_lossy().starts_with(&names.prefix) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iceoryx2::port::ReceiveError;

    /// Empty objects of the server's prefix are removed once stale, young ones are counted and
    /// left, and nothing else is touched.
    #[test]
    fn stale_empty_objects_of_the_prefix_go_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        let make = |name: &str, bytes: &[u8], stale: bool| {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            if stale {
                std::fs::File::options()
                    .write(true)
                    .open(&path)
                    .unwrap()
                    .set_modified(old)
                    .unwrap();
            }
            path
        };
        let stale_empty = make("okvab_1.connection", b"", true);
        let young_empty = make("okvab_2.connection", b"", false);
        let stale_full = make("okvab_3.connection", b"data", true);
        let other_server = make("okvcd_4.connection", b"", true);
        let young = remove_stale_empty_objects(dir.path(), "okvab_", EMPTY_IS_STALE_AFTER);
        assert_eq!(young, 1);
        assert!(!stale_empty.exists());
        assert!(young_empty.exists() && stale_full.exists() && other_server.exists());
    }

    #[test]
    fn a_session_whose_held_requests_fill_it_waits_instead_of_failing_the_receive() {
        let dir = tempfile::tempdir().unwrap();
        let names = IpcNames::for_socket(&dir.path().join("s.sock"));
        let node =
            NodeBuilder::new().config(&config(&names).unwrap()).create::<IpcService>().unwrap();
        let (service, server) = create_session_service(&node, "held-requests", 2).unwrap();
        let client = service
            .client_builder()
            .initial_max_slice_len(16)
            .allocation_strategy(AllocationStrategy::PowerOfTwo)
            .create()
            .unwrap();
        let send = |b: u8| client.loan_slice_uninit(1).unwrap().write_from_slice(&[b]).send();
        let (first, second) = (send(1).unwrap(), send(2).unwrap());
        let mut held: Vec<ActiveRequest> =
            (0..2).map(|_| server.receive().unwrap().expect("a request")).collect();
        // The client drops both (cancelled transfers) and sends a third; the server is still
        // running the two it took.
        drop((first, second));
        let third = send(3).expect("the client's side counts only what it still holds");
        assert!(
            matches!(server.receive(), Err(ReceiveError::ExceedsMaxBorrows)),
            "a plain receive fails while the port holds its most"
        );
        assert!(receive_within(&server, held.len(), 2).unwrap().is_none(), "waits");
        held.pop();
        let next = receive_within(&server, held.len(), 2).unwrap().expect("the waiting one");
        assert_eq!(next.payload(), &[3]);
        drop((next, held, third, client, server, service, node));
        remove_leftovers(&names);
    }
}
