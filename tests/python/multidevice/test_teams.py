"""Teams of ranks agree among themselves.

A fusion whose meshes name a part of the world (a tensor-parallel group of
a (dp, tp) mesh, say) is agreed on by those ranks alone: its calls are
numbered, matched and checked among them, and they make their own process
groups. Two teams run the same fusion on their own ranks side by side, and
a mismatch inside one team raises on every rank of that team, naming
global ranks, while the other team's call runs.
"""

from __future__ import annotations

import pytest
import torch

from hostir import DeviceMesh, FusionDefinition, ParallelType, RankMismatchError, shard_tensor

pytestmark = pytest.mark.usefixtures("_even_world")


@pytest.fixture
def _even_world(world):
    if world.size < 4 or world.size % 2:
        pytest.skip("teams of two ranks side by side: needs an even world of at least 4 ranks")


def team_of(world) -> list[int]:
    """This rank's team: ranks (0, 1), (2, 3), ..."""
    first = world.rank - world.rank % 2
    return [first, first + 1]


def allgather_fd(ranks):
    """x [len(ranks), n] sharded on axis 0 over `ranks` -> y replicated."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[len(ranks), -1], dtype=torch.float32)
        y = fd.ops.set(x)
        fd.add_output(y)
    for tv in (x, y):
        tv.set_device_mesh(DeviceMesh(ranks))
    x.axis(0).parallelize(ParallelType.mesh_x)
    return fd, x


def gathered(fd, x, full):
    (y,) = fd.execute([shard_tensor(full, x)])
    torch.testing.assert_close(y, full)


def test_two_teams_run_the_same_fusion_side_by_side(world, device):
    team = team_of(world)
    fd, x = allgather_fd(team)
    everyone, ex = allgather_fd(list(range(world.size)))
    for n in (3, 3, 3, 5, 5):
        # Each team's own data: the same on its ranks, other than the other team's.
        torch.manual_seed(1000 * team[0] + n)
        gathered(fd, x, torch.randn(2, n, device=device))
    # The teams' calls are numbered apart from the world's: a fusion of
    # every rank still runs, from its first call to its prepared ones.
    torch.manual_seed(7)
    for _ in range(3):
        gathered(everyone, ex, torch.randn(world.size, 4, device=device))


def test_a_mismatch_in_one_team_raises_on_its_ranks_alone(world, device):
    team = team_of(world)
    fd, x = allgather_fd(team)
    torch.manual_seed(1000 * team[0])
    full = torch.randn(2, 3, device=device)
    gathered(fd, x, full)
    gathered(fd, x, full)
    odd = torch.randn(2, 6, device=device)
    # The last rank of the last team passes other shapes.
    last = world.size - 1
    mine = odd if world.rank == last else full
    if last in team:
        with pytest.raises(RankMismatchError) as info:
            fd.execute([shard_tensor(mine, x)])
        message = str(info.value)
        assert f"rank {last} input 0 has shape [1, 6]" in message, message
        assert f"but rank {last - 1} input 0 has shape [1, 3]" in message, message
    else:
        gathered(fd, x, full)
    # Every team is in step afterwards, and so is the world.
    gathered(fd, x, full)
    everyone, ex = allgather_fd(list(range(world.size)))
    torch.manual_seed(11)
    gathered(everyone, ex, torch.randn(world.size, 2, device=device))
