"""Scale-out on Ray Serve: engine replicas behind one OpenAI-compatible ingress, routed by prefix, adapter and load.

    client --HTTP--> ingress (api/ app; cluster/ingress.py: ClusterSystem) --Serve handle, routed by
        cluster/router.py (policy: cluster/routing_policy.py over cluster/prefix_index.py)--> replicas
        (cluster/replica.py: EngineReplica, one ServingSystem each) --streamed deltas--> ingress

Replicas report what they cache (cluster/reports.py) through Ray Serve's routing-stats channel; adapters
come from one shared store (cluster/adapter_store.py); cluster/launch.py starts Ray and the deployment.
The policy modules (routing_policy, prefix_index, reports) are plain synchronous code: the simulation
(evals/routing_sim.py) runs the same policy without Ray.
"""
