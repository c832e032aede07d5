//! Engine registrations: a slot per registered engine rank, a generation from a counter that
//! never repeats, and the session that owns it. Generic over what is registered so that the
//! rules are tested without a GPU.

use orbitkv_proto::ErrorCode;
use orbitkv_shards::SessionId;

struct Entry<M> {
    session: SessionId,
    generation: u64,
    device: usize,
    memory: M,
}

/// The registrations of one server.
pub struct Registry<M> {
    slots: Vec<Option<Entry<M>>>,
    next_generation: u64,
    max: usize,
}

impl<M: Clone> Registry<M> {
    /// An empty registry holding at most `max` registrations.
    pub fn new(max: usize) -> Self {
        Self { slots: Vec::new(), next_generation: 0, max }
    }

    /// Registrations open now.
    pub fn len(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Adds a registration; returns (id, generation). `Busy` at the bound.
    pub fn insert(
        &mut self,
        session: SessionId,
        device: usize,
        memory: M,
    ) -> Result<(u64, u64), (ErrorCode, String)> {
        if self.len() >= self.max {
            return Err((
                ErrorCode::Busy,
                format!("{} GPU registrations are open (--max-gpu-registrations)", self.max),
            ));
        }
        self.next_generation += 1;
        let generation = self.next_generation;
        let entry = Entry { session, generation, device, memory };
        let id = match self.slots.iter().position(Option::is_none) {
            Some(i) => {
                self.slots[i] = Some(entry);
                i
            }
            None => {
                self.slots.push(Some(entry));
                self.slots.len() - 1
            }
        };
        Ok((id as u64, generation))
    }

    /// The registration `(id, generation)` of `session`: its device and memory. Another
    /// session's registration is `NotFound`, as is an empty slot; a slot of this session
    /// holding another generation is `StaleGeneration`.
    pub fn get(
        &self,
        session: SessionId,
        id: u64,
        generation: u64,
    ) -> Result<(usize, M), (ErrorCode, String)> {
        let slot =
            usize::try_from(id).ok().and_then(|i| self.slots.get(i)).and_then(Option::as_ref);
        match slot {
            Some(e) if e.session == session && e.generation == generation => {
                Ok((e.device, e.memory.clone()))
            }
            Some(e) if e.session == session => Err((
                ErrorCode::StaleGeneration,
                format!("registration {id} is generation {}, not {generation}", e.generation),
            )),
            _ => Err((ErrorCode::NotFound, format!("no GPU registration {id} in this session"))),
        }
    }

    /// Removes `(id, generation)` of `session` and returns its memory.
    pub fn remove(
        &mut self,
        session: SessionId,
        id: u64,
        generation: u64,
    ) -> Result<M, (ErrorCode, String)> {
        self.get(session, id, generation)?;
        let e = self.slots[id as usize].take().expect("found just above");
        Ok(e.memory)
    }

    /// Removes every registration of `session`; returns their memory.
    pub fn remove_session(&mut self, session: SessionId) -> Vec<M> {
        let mut out = Vec::new();
        for slot in self.slots.iter_mut() {
            if slot.as_ref().is_some_and(|e| e.session == session) {
                out.extend(slot.take().map(|e| e.memory));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_never_repeat_and_stale_ones_are_refused() {
        let mut r = Registry::new(8);
        let (id, g1) = r.insert(1, 0, "a").unwrap();
        assert_eq!(r.get(1, id, g1).unwrap(), (0, "a"));
        assert_eq!(r.remove(1, id, g1).unwrap(), "a");
        assert_eq!(r.get(1, id, g1).unwrap_err().0, ErrorCode::NotFound);
        // The slot is reused with a newer generation; the old one is stale.
        let (id2, g2) = r.insert(1, 0, "b").unwrap();
        assert_eq!(id2, id);
        assert!(g2 > g1);
        assert_eq!(r.get(1, id, g1).unwrap_err().0, ErrorCode::StaleGeneration);
        assert_eq!(r.remove(1, id, g1).unwrap_err().0, ErrorCode::StaleGeneration);
        assert_eq!(r.get(1, id, g2).unwrap(), (0, "b"));
    }

    #[test]
    fn registrations_belong_to_their_session() {
        let mut r = Registry::new(8);
        let (id, g) = r.insert(1, 2, "a").unwrap();
        assert_eq!(r.get(2, id, g).unwrap_err().0, ErrorCode::NotFound);
        assert_eq!(r.remove(2, id, g).unwrap_err().0, ErrorCode::NotFound);
        r.insert(1, 0, "b").unwrap();
        let (other, og) = r.insert(2, 0, "c").unwrap();
        assert_eq!(r.remove_session(1).len(), 2);
        assert_eq!(r.len(), 1);
        assert_eq!(r.get(2, other, og).unwrap(), (0, "c"));
        assert_eq!(r.get(1, id, g).unwrap_err().0, ErrorCode::NotFound);
    }

    #[test]
    fn the_bound_is_busy_and_ids_out_of_range_are_not_found() {
        let mut r = Registry::new(2);
        r.insert(1, 0, ()).unwrap();
        let (id, g) = r.insert(1, 0, ()).unwrap();
        let (code, msg) = r.insert(1, 0, ()).unwrap_err();
        assert_eq!(code, ErrorCode::Busy);
        assert!(msg.contains("--max-gpu-registrations"), "{msg}");
        r.remove(1, id, g).unwrap();
        r.insert(1, 0, ()).unwrap();
        assert_eq!(r.get(1, u64::MAX, 1).unwrap_err().0, ErrorCode::NotFound);
        assert_eq!(r.get(1, 1 << 40, 1).unwrap_err().0, ErrorCode::NotFound);
    }
}
