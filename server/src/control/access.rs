//! Who may do what: the peer credentials (`SO_PEERCRED`) of a connection against the allow
//! lists. Sessions: the server's uid, root, `--allow-uid` and processes whose effective group
//! is in `--allow-gid`. Admin commands that read (health, stats, sessions, peers): the same
//! set. Admin commands that change state (drain, resume, evict): the server's uid, root and
//! `--admin-uid`. The sockets themselves are mode 0660 in `--socket-group` (else the server's
//! group), so nobody else reaches these checks at all.

use crate::config::ServerConfig;

/// Why a uid may not do something; the message names the flags that would allow it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    /// A session (or a reading admin command) by a uid and group not on the lists.
    #[error(
        "uid {uid} (gid {gid}) is not allowed to connect (allowed: the server's uid {own_uid}, \
         root, --allow-uid {allow_uid:?}, --allow-gid {allow_gid:?})"
    )]
    Connect {
        /// The caller's uid.
        uid: u32,
        /// Its effective group.
        gid: u32,
        /// The server's uid.
        own_uid: u32,
        /// `--allow-uid`.
        allow_uid: Vec<u32>,
        /// `--allow-gid`.
        allow_gid: Vec<u32>,
    },
    /// An admin command that changes state, by a uid not allowed to.
    #[error(
        "uid {uid} may not {what}: admin commands that change state are for the server's uid \
         {own_uid}, root and --admin-uid {admin_uid:?}"
    )]
    Change {
        /// The caller's uid.
        uid: u32,
        /// The command.
        what: String,
        /// The server's uid.
        own_uid: u32,
        /// `--admin-uid`.
        admin_uid: Vec<u32>,
    },
    /// A namespace another uid registered first.
    #[error(
        "namespace {id:#018x} (model {model:?}) belongs to uid {owner}: tenants do not share \
         namespaces unless the model is declared shared (--shared-model)"
    )]
    Namespace {
        /// The namespace.
        id: u64,
        /// Its model.
        model: String,
        /// The uid that owns it.
        owner: u32,
    },
}

/// The allow lists, as configured.
#[derive(Clone, Debug)]
pub struct Access {
    own_uid: u32,
    allow_uid: Vec<u32>,
    allow_gid: Vec<u32>,
    admin_uid: Vec<u32>,
}

impl Access {
    /// The lists of `config`, for a server running as `own_uid`.
    pub fn new(config: &ServerConfig, own_uid: u32) -> Self {
        Self {
            own_uid,
            allow_uid: config.allow_uid.clone(),
            allow_gid: config.allow_gid.clone(),
            admin_uid: config.admin_uid.clone(),
        }
    }

    /// Whether a process of `uid` and effective group `gid` may open a session (and read the
    /// admin answers); why not, naming the flags, if it may not.
    pub fn may_connect(&self, uid: u32, gid: u32) -> Result<(), Denied> {
        if uid == self.own_uid
            || uid == 0
            || self.allow_uid.contains(&uid)
            || self.allow_gid.contains(&gid)
        {
            return Ok(());
        }
        Err(Denied::Connect {
            uid,
            gid,
            own_uid: self.own_uid,
            allow_uid: self.allow_uid.clone(),
            allow_gid: self.allow_gid.clone(),
        })
    }

    /// Whether `uid` may run an admin command that changes state (`what`); why not if not.
    pub fn may_change(&self, uid: u32, what: &str) -> Result<(), Denied> {
        if uid == self.own_uid || uid == 0 || self.admin_uid.contains(&uid) {
            return Ok(());
        }
        Err(Denied::Change {
            uid,
            what: what.to_owned(),
            own_uid: self.own_uid,
            admin_uid: self.admin_uid.clone(),
        })
    }
}

/// Which uid owns each namespace registered in this run: a namespace belongs to the first uid
/// that registers it, unless its model is shared (`--shared-model`): then it is everyone's.
#[derive(Debug, Default)]
pub struct NamespaceOwners {
    shared_models: Vec<String>,
    owners: std::sync::Mutex<std::collections::HashMap<u64, u32>>,
}

impl NamespaceOwners {
    /// The owner table of a server whose shared models are `shared_models`.
    pub fn new(shared_models: Vec<String>) -> Self {
        Self { shared_models, owners: Default::default() }
    }

    /// Takes namespace `id` (of model `model`) for `uid`: true when this call made `uid` its
    /// owner (to undo with [`NamespaceOwners::release`] if the registration then fails);
    /// why not, naming the flag, when another uid owns it.
    pub fn claim(&self, id: u64, model: &str, uid: u32) -> Result<bool, Denied> {
        if self.shared_models.iter().any(|m| m == model) {
            return Ok(false);
        }
        let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
        match owners.get(&id) {
            Some(&owner) if owner == uid => Ok(false),
            Some(&owner) => Err(Denied::Namespace { id, model: model.to_owned(), owner }),
            None => {
                owners.insert(id, uid);
                Ok(true)
            }
        }
    }

    /// Forgets the owner a failed registration claimed (`claimed` as [`NamespaceOwners::claim`]
    /// answered).
    pub fn release(&self, id: u64, claimed: bool) {
        if claimed {
            self.owners.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_is_its_first_registrants_unless_its_model_is_shared() {
        let owners = NamespaceOwners::new(vec!["shared-m".into()]);
        assert_eq!(owners.claim(1, "private", 1000), Ok(true));
        assert_eq!(owners.claim(1, "private", 1000), Ok(false), "the owner again");
        let why = owners.claim(1, "private", 2000).unwrap_err().to_string();
        assert!(why.contains("belongs to uid 1000") && why.contains("--shared-model"), "{why}");
        for uid in [1000, 2000, 0] {
            assert_eq!(owners.claim(2, "shared-m", uid), Ok(false), "shared: everyone's");
        }
        // A failed registration gives its claim back: another uid may take it then.
        assert_eq!(owners.claim(3, "other", 2000), Ok(true));
        owners.release(3, true);
        assert_eq!(owners.claim(3, "other", 1000), Ok(true));
        owners.release(3, false);
        assert!(owners.claim(3, "other", 2000).is_err(), "not claimed by that call: kept");
    }

    fn access() -> Access {
        let config = ServerConfig {
            allow_uid: vec![1000],
            allow_gid: vec![2000],
            admin_uid: vec![1001],
            ..ServerConfig::default()
        };
        Access::new(&config, 500)
    }

    #[test]
    fn sessions_for_own_root_and_the_allow_lists() {
        let a = access();
        for (uid, gid) in [(500, 9), (0, 9), (1000, 9), (7, 2000)] {
            assert!(a.may_connect(uid, gid).is_ok(), "{uid}/{gid}");
        }
        let why = a.may_connect(7, 9).unwrap_err().to_string();
        assert!(why.contains("uid 7 (gid 9)") && why.contains("--allow-gid [2000]"), "{why}");
    }

    #[test]
    fn state_changes_for_own_root_and_admin_uids_only() {
        let a = access();
        for uid in [500, 0, 1001] {
            assert!(a.may_change(uid, "drain").is_ok(), "{uid}");
        }
        // Allowed a session is not allowed to change state.
        let why = a.may_change(1000, "drain").unwrap_err().to_string();
        assert!(
            why.contains("uid 1000 may not drain") && why.contains("--admin-uid [1001]"),
            "{why}"
        );
    }
}
