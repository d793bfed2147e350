//! Checks of everything the types cannot say; each error names its place.

use std::collections::BTreeSet;
use std::net::SocketAddr;

use super::error::{invalid, ConfigError};
use super::schema::{
    Config, InFlightConfig, PoolConfig, TokenizerSource, MAX_SCRAPE_INTERVAL_MS,
    MIN_GRPC_MAX_MESSAGE_BYTES, MIN_SCRAPE_INTERVAL_MS,
};
use crate::types::IndexSource;

impl Config {
    /// Checks ranges and consistency; the first problem is returned with
    /// its path.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // The controller's pools file may list none yet; it rolls the
        // indexer when it does.
        if self.pools.is_empty() && self.pools_file.is_none() {
            return Err(invalid(
                "pools",
                "no pools configured (give --config FILE or --endpoint pool=...,address=...,events=...)",
            ));
        }
        let mut names = BTreeSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let at = format!("pools[{i}]");
            validate_pool(pool, &at)?;
            if !names.insert(pool.name.as_str()) {
                return Err(invalid(
                    format!("{at}.name"),
                    format!("duplicate pool name `{}`", pool.name),
                ));
            }
        }
        if self.grpc_max_message_bytes < MIN_GRPC_MAX_MESSAGE_BYTES {
            return Err(invalid(
                "grpcMaxMessageBytes",
                format!("must be at least {MIN_GRPC_MAX_MESSAGE_BYTES}"),
            ));
        }
        self.responses.validate()?;
        self.budgets.validate()?;
        let mut served = BTreeSet::new();
        for (i, p) in self.pickers.iter().enumerate() {
            if !served.insert(p.pool.as_str()) {
                return Err(invalid(
                    format!("pickers[{i}].pool"),
                    format!("pool `{}` has a picker already", p.pool),
                ));
            }
        }
        self.shared_load.validate()
    }
}

/// Checks one pool; `at` is its place (`pools[1]`, or a pools file's).
pub(crate) fn validate_pool(pool: &PoolConfig, at: &str) -> Result<(), ConfigError> {
    if pool.name.trim().is_empty() {
        return Err(invalid(format!("{at}.name"), "must not be empty"));
    }
    if pool.block_size == 0 || pool.block_size > 1024 {
        return Err(invalid(format!("{at}.blockSize"), "must be 1..=1024"));
    }
    if let TokenizerSource::Dir(dir) = &pool.tokenizer {
        if !dir.join("tokenizer.json").is_file() {
            return Err(invalid(
                format!("{at}.tokenizer"),
                format!(
                    "`{}` is not a tokenizer directory (no tokenizer.json); use a directory, `render` or `approx`",
                    dir.display()
                ),
            ));
        }
    }
    match (&pool.discovery, pool.endpoints.is_empty()) {
        (Some(_), false) => {
            return Err(invalid(
                at.to_string(),
                "give either endpoints or discovery, not both",
            ))
        }
        (None, true) => {
            return Err(invalid(
                format!("{at}.endpoints"),
                "no endpoints and no discovery",
            ))
        }
        _ => {}
    }
    let mut seen = BTreeSet::new();
    for (j, ep) in pool.endpoints.iter().enumerate() {
        let eat = format!("{at}.endpoints[{j}]");
        if ep.address.parse::<SocketAddr>().is_err() {
            return Err(invalid(
                format!("{eat}.address"),
                format!("not ip:port: `{}`", ep.address),
            ));
        }
        if !seen.insert(ep.address.as_str()) {
            return Err(invalid(
                format!("{eat}.address"),
                format!("duplicate address `{}`", ep.address),
            ));
        }
        // Without events the engine is asked for its sockets (index
        // `events`) or nothing subscribes (`picks`); given, they are checked
        // for form.
        match &ep.events {
            Some(e) => check_zmq(e, &format!("{eat}.events"))?,
            None if pool.index == IndexSource::Events => {
                // Replay and topic come with the engine's answer: written
                // here they would be silently ignored.
                let ignored = [
                    ("replay", ep.replay.is_some()),
                    ("topic", !ep.topic.is_empty()),
                ];
                if let Some((key, _)) = ignored.iter().find(|(_, set)| *set) {
                    return Err(invalid(
                        format!("{eat}.{key}"),
                        "needs events: without an events address the engine's own /kv_event_sources gives its events, replay and topic",
                    ));
                }
            }
            None => {}
        }
        if let Some(r) = &ep.replay {
            check_zmq(r, &format!("{eat}.replay"))?;
        }
        if let Some(m) = &ep.metrics {
            if !m.starts_with("http://") {
                return Err(invalid(
                    format!("{eat}.metrics"),
                    format!("not an http:// URL: `{m}`"),
                ));
            }
        }
    }
    if let Some(d) = &pool.discovery {
        let dat = format!("{at}.discovery");
        if d.namespace.is_empty() {
            return Err(invalid(format!("{dat}.namespace"), "must not be empty"));
        }
        if d.inference_pool.is_empty() {
            return Err(invalid(format!("{dat}.inferencePool"), "must not be empty"));
        }
        if d.events_port == Some(0) {
            return Err(invalid(format!("{dat}.eventsPort"), "must be 1..=65535"));
        }
        if d.replay_port == Some(0) {
            return Err(invalid(format!("{dat}.replayPort"), "must be 1..=65535"));
        }
        if d.kv_event_sources == Some(true) {
            // The engine's answer replaces the pool-wide defaults: a port or
            // topic written next to it would never be used.
            let unused = [
                ("eventsPort", d.events_port.is_some()),
                ("replayPort", d.replay_port.is_some()),
                ("topic", !d.topic.is_empty()),
            ];
            if let Some((key, _)) = unused.iter().find(|(_, set)| *set) {
                return Err(invalid(
                    format!("{dat}.{key}"),
                    "unused with kvEventSources: true (each engine advertises its own); drop it, or set kvEventSources: false",
                ));
            }
        }
    }
    let s = &pool.scrape;
    if !(MIN_SCRAPE_INTERVAL_MS..=MAX_SCRAPE_INTERVAL_MS).contains(&s.interval_ms) {
        return Err(invalid(
            format!("{at}.scrape.intervalMs"),
            format!(
                "must be {MIN_SCRAPE_INTERVAL_MS}..={MAX_SCRAPE_INTERVAL_MS}, got {}",
                s.interval_ms
            ),
        ));
    }
    if s.timeout_ms == 0 || s.timeout_ms > s.interval_ms {
        return Err(invalid(
            format!("{at}.scrape.timeoutMs"),
            format!(
                "must be 1..=intervalMs ({}), got {}",
                s.interval_ms, s.timeout_ms
            ),
        ));
    }
    at_least_one(s.unhealthy_after, || format!("{at}.scrape.unhealthyAfter"))?;
    at_least_one(pool.in_flight.timeout_s, || {
        format!("{at}.inFlight.timeoutS")
    })?;
    validate_in_flight_bounds(&pool.in_flight, at)?;
    at_least_one(pool.render_timeout_ms, || format!("{at}.renderTimeoutMs"))?;
    at_least_one(pool.pick_history_blocks, || {
        format!("{at}.pickHistoryBlocks")
    })?;
    // The sections check themselves and name only their own field.
    let within = |section: &'static str| {
        move |(field, msg): (&'static str, String)| invalid(format!("{at}.{section}.{field}"), msg)
    };
    pool.scoring.validate().map_err(within("scoring"))?;
    pool.saturation.validate().map_err(within("saturation"))?;
    pool.tokenize_budget
        .validate()
        .map_err(within("tokenizeBudget"))?;
    pool.failures.validate().map_err(within("failures"))?;
    pool.flow_control
        .validate()
        .map_err(|e| invalid(format!("{at}.flowControl.{}", e.field), e.message))?;
    Ok(())
}

fn validate_in_flight_bounds(f: &InFlightConfig, at: &str) -> Result<(), ConfigError> {
    let max_ms = f.timeout_s.saturating_mul(1000);
    if f.unconfirmed_timeout_ms == 0 || f.unconfirmed_timeout_ms > max_ms {
        return Err(invalid(
            format!("{at}.inFlight.unconfirmedTimeoutMs"),
            format!(
                "must be 1..=timeoutS in ms ({max_ms}), got {}",
                f.unconfirmed_timeout_ms
            ),
        ));
    }
    at_least_one(f.max_unconfirmed_per_endpoint, || {
        format!("{at}.inFlight.maxUnconfirmedPerEndpoint")
    })?;
    at_least_one(f.max_tracked, || format!("{at}.inFlight.maxTracked"))?;
    Ok(())
}

fn check_zmq(endpoint: &str, path: &str) -> Result<(), ConfigError> {
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| {
        invalid(
            path,
            format!("not a tcp://host:port endpoint: `{endpoint}`"),
        )
    })?;
    let ok = rest
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if !ok {
        return Err(invalid(
            path,
            format!("not a tcp://host:port endpoint: `{endpoint}`"),
        ));
    }
    Ok(())
}

/// Zero is never usable for the keys checked with this (counts, timeouts,
/// capacities); one message for all keeps the errors alike.
fn at_least_one<N: Default + PartialEq>(
    value: N,
    path: impl FnOnce() -> String,
) -> Result<(), ConfigError> {
    if value == N::default() {
        return Err(invalid(path(), "must be at least 1"));
    }
    Ok(())
}
