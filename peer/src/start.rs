//! How peering starts: the arena registered with Transfer Engine, the owner side serving the
//! peer RPC, the requester side following the members and performing the shards' reads.

use std::sync::Arc;

use crate::node::{fetch_queue, FetchQueue, PeeringConfig, PeeringError, Sides};
use crate::Cluster;

impl Cluster {
    /// Starts peering on the peer thread: registers the arena with TE, serves the peer RPC on
    /// `--peer-addr`, follows the members' inventories and performs the shards' peer reads.
    /// The queue is where shards queue their [`PeerFetch`](orbitkv_proto::PeerFetch)es (bounded: a full queue is a miss).
    pub fn start_peering(self: &Arc<Self>, cfg: PeeringConfig) -> Result<FetchQueue, PeeringError> {
        let te = self.te.clone().ok_or(PeeringError::NoTransferEngine)?;
        let listener = self
            .listener
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or(PeeringError::AlreadyStarted)?;
        te.register(cfg.arena.0, cfg.arena.1).map_err(PeeringError::Register)?;
        let (tx, rx) = fetch_queue();
        let cfg = Arc::new(cfg);
        let window =
            if self.cfg.cpus.len() >= 2 { cfg.spin_window } else { std::time::Duration::ZERO };
        tracing::info!(
            spin_window_us = window.as_micros() as u64,
            cores = self.cfg.cpus.len(),
            "peer thread polls after activity for this long (two cores or more needed)"
        );
        let sides =
            Sides { cluster: Arc::clone(self), cfg, te, warm: crate::hot::Warm::new(window) };
        let owner = crate::owner::Owner::new(sides.clone());
        self.runtime.spawn(async move {
            owner.serve(listener).await;
        });
        let requester = crate::requester::Requester::new(sides);
        self.runtime.spawn(requester.run(rx));
        Ok(tx)
    }
}
