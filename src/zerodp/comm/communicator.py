"""Making a communicator: torch's `new_group`, handed out only once every member has connected to it.

[Note: a communicator is made when every member has connected] gloo connects a new group's ranks in
`new_group` itself (connectFullMesh): each rank publishes its listening address in the store, reads its peers'
addresses, and of each pair of ranks one dials the other's listener and writes a sequence number. The dialing
rank is done as soon as that write has gone out; the listening rank is done when its loop thread has handed it
the socket, and that happens only after it has read the dialer's address from the store, which can be much
later: torch's FileStore is polled every 10 ms, and a loaded machine delays any rank. So `new_group` returns on
one rank while its peer is still connecting. If that rank then destroys the group before any collective on
it (an engine built and closed at once, whose reduce-scatter communicator was never used; a MiCS or hpZ
block made and dropped), its socket closes, and the peer, taking the socket only now, finds it closed:
"Gloo connectFullMesh failed with ... Connection closed by peer", on the peer alone, while the first rank has
gone on and waits for it in its next collective. (tests/dist's intermittent failure: a 2-rank pool building
and closing 20 engines per case under CPU load failed 5 of 10 cases this way without the wait, 0 of 20 with it.)

So on gloo every member joins a one-element all-reduce over the new communicator before `new_group` returns:
when it completes on any rank, every member has finished connecting (each took part in it), and no later
destroy can meet a connect still in progress. A CPU tensor, so that a "cpu:gloo,cuda:nccl" group also runs it
on gloo; NCCL connects lazily, at a communicator's first collective, so nothing of the kind is issued there.
The default group gets the same wait (`wait_for_members`) where zerodp creates it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .backend import gloo_serves_cpu


def wait_for_members(group: Optional[dist.ProcessGroup] = None) -> None:
    """Return once every member of the new communicator `group` (None: the default group) has connected to it,
    where its backend connects at creation (gloo): [Note: a communicator is made when every member has connected].
    Every member calls it, right after making the group."""
    if not gloo_serves_cpu(str(dist.get_backend(group))) or dist.get_world_size(group) == 1:
        return
    # a sync point by design: each member's part in it proves that member's connections are complete
    dist.all_reduce(torch.zeros(1), group=group)


def new_group(ranks: list[int], backend: Optional[str], local: bool = False) -> dist.ProcessGroup:
    """torch's `new_group(ranks, backend=backend)` (None: the default group's backend), returned once every member
    has connected to it.

    `local`: made by the members alone (`use_local_synchronization=True`, see [Note: local communicators]);
    otherwise every rank of the job calls it, in one order, and a rank outside `ranks` gets torch's non-member
    value without waiting."""
    group = dist.new_group(list(ranks), backend=backend, use_local_synchronization=local)
    if dist.get_rank() in ranks:
        wait_for_members(group)
    return group
