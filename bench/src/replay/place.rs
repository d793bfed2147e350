//! How the replay places requests: the run's own choices, the indexer's
//! ranking with fresh state, and the queue model's oracle rules.

use kvasir_scoring::{Candidate, Request, Weights};

use super::Cluster;

/// How requests are placed.
#[derive(Debug, Clone, PartialEq)]
pub enum Placement {
    /// On the engine the run placed them on.
    Own,
    /// Conversations dealt over the engines in turn as they start, each
    /// staying on its engine: every engine gets an even share of the
    /// conversations and soon holds every system prompt, with no router
    /// knowledge at all.
    Dealt,
    /// At arrival, by the cache-indexer's ranking with these weights
    /// ([`kvasir_scoring::rank`]), over what an indexer would know if its
    /// scrapes and shared load were never stale: each engine's cache
    /// (blocks count from the step that computes them, as the indexer
    /// matches picks still in prefill), running and waiting requests, KV
    /// use, picks without a first token and their uncached tokens, and the
    /// conversations it started recently.
    Scored(Box<Weights>),
    /// At arrival, on the engine where the first token is due soonest
    /// (backlog plus its own prefill there), a move off the engine holding
    /// most of its prompt priced `move_penalty` times the extra prefill it
    /// adds.
    AtArrival {
        /// Share of a move's extra prefill counted against it.
        move_penalty: f64,
    },
    /// In one queue until an engine frees (its backlog of uncached prompt
    /// tokens at most `free_tokens`); the engine free longest takes the
    /// oldest, or the quickest on it, of the requests it may take: any
    /// whose best-holding engine would not, with the move priced as
    /// above, give it its first token sooner.
    Central {
        /// The quickest on the freed engine first, else the oldest.
        quickest: bool,
        /// Share of a move's extra prefill counted against it.
        move_penalty: f64,
        /// Uncached prompt tokens still to prefill at which an engine
        /// counts as free.
        free_tokens: u64,
    },
}

impl Placement {
    /// Parses `own`, `dealt`, `at-arrival:PENALTY` or
    /// `central:oldest|quickest:PENALTY[:FREE_TOKENS]`.
    pub fn parse(s: &str) -> Result<Placement, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let num = |p: &str| {
            p.parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| format!("{s:?}: {p:?} is not a number >= 0"))
        };
        match parts.as_slice() {
            ["own"] => Ok(Placement::Own),
            ["dealt"] => Ok(Placement::Dealt),
            ["at-arrival", p] => Ok(Placement::AtArrival {
                move_penalty: num(p)?,
            }),
            ["central", order, p, rest @ ..] if rest.len() <= 1 => {
                let quickest = match *order {
                    "quickest" => true,
                    "oldest" => false,
                    o => return Err(format!("{s:?}: order {o:?} is neither oldest nor quickest")),
                };
                let free_tokens = match rest {
                    [f] => f
                        .parse::<u64>()
                        .map_err(|_| format!("{s:?}: {f:?} is not a token count"))?,
                    _ => 0,
                };
                Ok(Placement::Central {
                    quickest,
                    move_penalty: num(p)?,
                    free_tokens,
                })
            }
            _ => Err(format!(
                "{s:?}: expected own, dealt, at-arrival:PENALTY or central:oldest|quickest:PENALTY[:FREE_TOKENS]"
            )),
        }
    }
}

/// Waiting requests at which the ranking counts an engine saturated (the
/// indexer's `saturation.waiting` default).
const SATURATION_WAITING: u32 = 5;

/// KV use at which the ranking leaves an engine out (the indexer's
/// `saturation.kvUsage` default).
const KV_FULL: f64 = 0.9;

impl Cluster<'_> {
    /// Request `r` reaches the router at `t`: it waits in the central
    /// queue, or goes where the placement says.
    pub(super) fn arrive(&mut self, r: usize, t: f64, placement: &Placement) {
        if let Placement::Central { .. } = placement {
            self.waiting.push(r);
            return;
        }
        let costs = self.costs(r);
        let e = self.at_arrival(r, t, placement, &costs);
        self.place(r, e, t, &costs);
    }

    /// The engine `placement` sends `r` to at `t`, given its `costs`; a
    /// central queue places nothing at arrival (its engine holding most of
    /// the prompt is answered, never used: [`Self::arrive`] queues it).
    fn at_arrival(&mut self, r: usize, t: f64, placement: &Placement, costs: &Costs) -> usize {
        match placement {
            Placement::Scored(w) => self.scored(r, t, w, costs),
            Placement::Own => {
                let turn = &self.convs[self.reqs[r].conv].turns[self.reqs[r].turn];
                turn.endpoint % self.nodes.len()
            }
            Placement::Dealt => {
                let conv = self.reqs[r].conv;
                let next = self.dealt.len() % self.nodes.len();
                *self.dealt.entry(conv).or_insert(next)
            }
            Placement::AtArrival { move_penalty } => {
                let home = costs.best_holder;
                let priced = |e: usize| {
                    self.nodes[e].backlog_ms()
                        + costs.alone[e]
                        + move_penalty * (costs.alone[e] - costs.alone[home])
                };
                let mut best = home;
                for e in 0..self.nodes.len() {
                    if priced(e) < priced(best) {
                        best = e;
                    }
                }
                best
            }
            Placement::Central { .. } => costs.best_holder,
        }
    }

    /// The ranking's first endpoint for `r` at `t` ([`Placement::Scored`]),
    /// recorded as a placement as the indexer records its picks.
    fn scored(&mut self, r: usize, t: f64, w: &Weights, costs: &Costs) -> usize {
        let bs = self.setup.engine.block_size;
        let req = &self.reqs[r];
        let chain: Vec<u64> = req.hashes.iter().map(|h| h.0).collect();
        let starts = self.placements.starts_conversation(&chain);
        let now_ms = t * 1e3;
        let addresses: Vec<String> = (0..self.nodes.len()).map(|e| format!("e{e:02}")).collect();
        let candidates: Vec<Candidate<'_>> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(e, n)| {
                let kv_usage = n.engine.pool().usage();
                let waiting = n.engine.num_waiting() as u32;
                let kv_full = kv_usage >= KV_FULL;
                Candidate {
                    address: &addresses[e],
                    matched_blocks: u32::try_from(costs.cached[e] / bs).unwrap_or(u32::MAX),
                    running: n.engine.num_running() as u32,
                    waiting,
                    kv_usage,
                    in_flight: n.active.len() as u32,
                    queued_prefill_tokens: n.backlog_tokens(),
                    healthy: true,
                    saturated: kv_full || waiting >= SATURATION_WAITING,
                    left_out: kv_full,
                    failing: false,
                    recent_placements: self.placements.recent(e, now_ms),
                }
            })
            .collect();
        let request = Request {
            prompt_tokens: u32::try_from(req.tokens.len()).unwrap_or(u32::MAX),
            block_size: u32::try_from(bs).unwrap_or(u32::MAX),
            seed: r as u64,
            max_endpoints: 1,
            indexed: true,
            starts_conversation: starts,
        };
        let pick = kvasir_scoring::rank(&request, &candidates, w)
            .order
            .first()
            .map_or(0, |f| f.candidate);
        self.placements.record(pick, &chain, starts, now_ms);
        pick
    }

    /// What `r`'s prefill would cost alone on each engine, and the engine
    /// holding most of its prompt (the least backlog among equals).
    pub(super) fn costs(&self, r: usize) -> Costs {
        let req = &self.reqs[r];
        let bs = self.setup.engine.block_size;
        // vLLM reuses full blocks within the first len-1 tokens only.
        let limit = (req.tokens.len().saturating_sub(1) / bs).min(req.hashes.len());
        let cached: Vec<usize> = self
            .nodes
            .iter()
            .map(|n| n.engine.pool().longest_cached_prefix(&req.hashes[..limit]) * bs)
            .collect();
        let alone: Vec<f64> = cached
            .iter()
            .map(|&c| self.setup.model.unqueued_ttft_ms(req.tokens.len(), c))
            .collect();
        let most = cached.iter().copied().max().unwrap_or(0);
        let best_holder = (0..self.nodes.len())
            .filter(|&e| cached[e] == most)
            .min_by(|&a, &b| {
                self.nodes[a]
                    .backlog_ms()
                    .total_cmp(&self.nodes[b].backlog_ms())
            })
            .unwrap_or(0);
        Costs {
            cached,
            alone,
            best_holder,
        }
    }

    /// The central queue at `t`: each free engine, free longest first,
    /// takes a waiting request it may take, until none can.
    pub(super) fn dispatch(&mut self, t: f64, quickest: bool, move_penalty: f64, free_tokens: u64) {
        loop {
            if self.waiting.is_empty() {
                return;
            }
            let mut free: Vec<usize> = (0..self.nodes.len())
                .filter(|&e| self.nodes[e].backlog_tokens() <= free_tokens)
                .collect();
            free.sort_by(|&a, &b| {
                let (na, nb) = (&self.nodes[a], &self.nodes[b]);
                na.free_since.total_cmp(&nb.free_since).then(a.cmp(&b))
            });
            let costs: Vec<Costs> = self.waiting.iter().map(|&r| self.costs(r)).collect();
            let mut placed = false;
            for e in free {
                let here = self.nodes[e].backlog_ms();
                let may = |c: &Costs| {
                    let h = c.best_holder;
                    c.cached[e] == c.cached[h]
                        || self.nodes[h].backlog_ms() + c.alone[h]
                            > here + c.alone[e] + move_penalty * (c.alone[e] - c.alone[h])
                };
                let key = |w: usize| {
                    let first = if quickest { costs[w].alone[e] } else { 0.0 };
                    (first, self.reqs[self.waiting[w]].sent)
                };
                let pick = (0..self.waiting.len())
                    .filter(|&w| may(&costs[w]))
                    .min_by(|&a, &b| {
                        let (ka, kb) = (key(a), key(b));
                        ka.0.total_cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
                    });
                if let Some(w) = pick {
                    let r = self.waiting.remove(w);
                    self.place(r, e, t, &costs[w]);
                    placed = true;
                    // Costs are by position in `waiting`: recompute.
                    break;
                }
            }
            if !placed {
                return;
            }
        }
    }
}

/// A request's prefill on each engine.
pub(super) struct Costs {
    /// Prompt tokens each engine holds.
    pub(super) cached: Vec<usize>,
    /// Its prefill alone on each engine, ms.
    pub(super) alone: Vec<f64>,
    /// The engine holding most of it (least backlog among equals).
    pub(super) best_holder: usize,
}
