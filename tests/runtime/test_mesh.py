"""The DP x TP mesh: TP groups of neighbouring ranks, DP groups across them (Megatron-LM's
Figure 8), also as a torch DeviceMesh over the same groups."""
import pytest


def _mesh(tp: int) -> dict:
    from autotp.distributed.mesh import get_mesh

    m = get_mesh(tp)
    dm = m.device_mesh
    return {"tp_ranks": m.tp_ranks, "dp_ranks": m.dp_ranks, "grid": dm.mesh.tolist(), "names": dm.mesh_dim_names,
            "local": (dm.get_local_rank("dp"), dm.get_local_rank("tp")), "ours": (m.dp_rank, m.tp_rank),
            "same_tp_group": tp == 1 or dm.get_group("tp") is m.tp_group}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_groups_are_neighbours_and_the_device_mesh_has_the_same_layout(cluster, tp):
    for rank, m in enumerate(cluster.run(_mesh, tp)):
        assert m["tp_ranks"] == tuple(range(rank - rank % tp, rank - rank % tp + tp))
        assert m["dp_ranks"] == tuple(range(rank % tp, 4, tp))
        assert m["grid"] == [list(range(b * tp, (b + 1) * tp)) for b in range(4 // tp)]
        assert m["names"] == ("dp", "tp") and m["local"] == m["ours"] and m["same_tp_group"]
