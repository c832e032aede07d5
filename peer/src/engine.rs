//! The Transfer Engine as peering uses it: one per process, or none in builds without a TE
//! route (then the type has no values and peering does not start).

#[cfg(feature = "te-python")]
mod imp {
    use std::sync::Arc;

    use crate::te::{TeError, TransferEngine};

    /// This process's Transfer Engine.
    #[derive(Clone, Debug)]
    pub(crate) struct Engine(Arc<TransferEngine>);

    impl Engine {
        /// Starts the engine on `host` (TCP; RDMA is chosen by TE where devices exist).
        pub(crate) fn start(host: &str) -> Result<Option<Engine>, TeError> {
            TransferEngine::new(host, "tcp").map(|e| Some(Engine(Arc::new(e))))
        }

        pub(crate) fn segment(&self) -> &str {
            self.0.segment()
        }

        pub(crate) fn register(&self, addr: u64, len: u64) -> Result<(), TeError> {
            self.0.register(addr, len)
        }

        /// Reads `(local, remote, len)` ranges of `peer`'s memory, waiting for all.
        pub(crate) fn read_many(
            &self,
            peer: &str,
            ranges: &[(u64, u64, u64)],
        ) -> Result<(), TeError> {
            self.0.read_many(peer, ranges)
        }
    }
}

#[cfg(not(feature = "te-python"))]
mod imp {
    /// No Transfer Engine in this build: [`Engine::start`] gives none, so peering does not
    /// start; the type exists so that peering compiles (and is checked) in every build.
    #[derive(Clone, Debug)]
    #[allow(dead_code)] // never constructed without a TE route
    pub(crate) struct Engine(());

    const NO_ROUTE: &str = "no Transfer Engine in this build";

    impl Engine {
        pub(crate) fn start(_host: &str) -> Result<Option<Engine>, std::convert::Infallible> {
            Ok(None)
        }

        pub(crate) fn segment(&self) -> &str {
            ""
        }

        pub(crate) fn register(&self, _addr: u64, _len: u64) -> Result<(), &'static str> {
            Err(NO_ROUTE)
        }

        pub(crate) fn read_many(
            &self,
            _peer: &str,
            _ranges: &[(u64, u64, u64)],
        ) -> Result<(), &'static str> {
            Err(NO_ROUTE)
        }
    }
}

pub(crate) use imp::Engine;
