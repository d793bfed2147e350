"""The fault suite (`make chaos`): scenarios that each inject one fault into
the local stack under a steady mixed load of the routed APIs, streamed and
not, and check what Kvasir promises (no request lost where none may be,
recovery within a bound), with the counts and timings written to
bench/results/chaos/.

Modules:
    load          the load: worker threads over the five APIs, one record per request
    stack         the stacks (sims, indexer replicas, Redis, Envoy, TCP proxies) and their readings
    tcpproxy      a TCP proxy that forwards, delays or blackholes a connection
    result        a scenario's checks, counts and figures
    indexers      an indexer replica killed; the indexer stopped and slowed; the network to it cut
    engines       an engine killed; its KV events lost, duplicated, reordered; its publisher restarted
    shared_store  Redis killed, stalled and restarted empty under two replicas
    controller    the controller given an invalid policy set and its API server gone
    run           runs scenarios, writes summary.json and summary.md; the command line (bench/chaos.py)
"""
