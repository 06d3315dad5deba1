"""conf/cluster/slurm.yaml's placement (orchestrator/config/slurm.py), without SLURM: the allocation's
nodes, which role goes where and through which transport, and the provenance tags."""

from __future__ import annotations

from orchestrator.config import slurm


def test_slurm_host_lists_expand_as_scontrol_show_hostnames_does():
    assert slurm.expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert slurm.expand_nodelist("vm") == ["vm"]
    assert slurm.expand_nodelist("") == []


def test_roles_go_on_the_allocated_nodes_local_where_the_job_runs():
    two = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n1"}
    assert [slurm.node(i, two) for i in (0, 1)] == ["n1", "n2"]
    assert [slurm.transport(i, two) for i in (0, 1)] == ["local", "ssh"]
    one = {"SLURM_JOB_NODELIST": "vm", "SLURMD_NODENAME": "vm"}
    # one node: prefill (0) and decode (1) both on it
    assert [slurm.node(i, one) for i in (0, 1)] == ["vm", "vm"]
    assert [slurm.transport(i, one) for i in (0, 1)] == ["local", "local"]
    # outside a job (the driver): this machine
    assert (slurm.node(1, {}), slurm.transport(1, {})) == ("127.0.0.1", "local")


def test_an_arm_in_a_slurm_job_records_its_id_nodes_and_partition():
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_PARTITION": "gpu"}
    assert slurm.allocation_tags(env) == {
        "slurm.job_id": "42",
        "slurm.nodes": "n[1-2]",
        "slurm.partition": "gpu",
    }
    assert slurm.allocation_tags({}) == {}
