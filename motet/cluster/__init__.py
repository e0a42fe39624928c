"""Scale-out on Ray Serve: engine replicas behind one OpenAI-compatible ingress, routed by prefix, adapter and load.

    client --HTTP--> ingress (api/ app; motet/cluster/cluster_system.py: ClusterSystem) --Serve handle, routed by
        motet/cluster/router.py (policy: motet/cluster/routing_policy.py over motet/cluster/prefix_index.py)--> replicas
        (motet/cluster/replica.py: EngineReplica, one ServingSystem each) --streamed deltas--> ingress

Replicas report what they cache (motet/cluster/reports.py) through Ray Serve's routing-stats channel; adapters
come from one shared store (motet/cluster/shared_adapter_store.py); motet/cluster/launch.py starts Ray and the
deployment.
The policy modules (routing_policy, prefix_index, reports) are plain synchronous code: the simulation
(benchmarks/routing_sim.py) runs the same policy without Ray.
"""
