"""The run wing: the side effects of one arm behind the transports (`orchestrator.remote`): the co-restart
and health gate (`deploy`), the preflight on the hosts (`preflight`, `engine_probe`), the host leases and
the cluster pool (`lease`, `pool`), the local side's checks and the server logs read back (`observe`)."""
