"""The k-center machinery of `subgen`'s kcenter mode (kvchat/compress/subgen.py): greedy
farthest-first selection (Gonzalez), and the streaming eviction that keeps a held set
spread out batch after batch (the younger of the closest pair goes, one at a time, with
each entry's nearest neighbour carried between batches).

A helper module, not a method: the registry imports only the modules named in
`kvchat.compress.METHOD_MODULES`, and nothing here is registered. Functions take keys
[H, n, d] per layer (KV head first) and return indices; they know nothing of weights or
values.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
import torch
from torch import Tensor

from kvchat import native

TILE = 16  # points per tile of the kernel's layout (kvchat/native/_farthest.c)

# Pairs of held entries (H·n²) up to which `subgen` keeps evicting one closest pair at a
# time, whose first neighbour search compares every pair; past it a batch is compressed
# from scratch by farthest-first, and the centres' neighbours are found at once only
# below it.
GRAM_LIMIT = 1 << 26


def farthest_first(keys: Tensor, k: int, track_owner: bool) -> tuple[Tensor, Tensor | None]:
    """Greedy k-center (Gonzalez) per head over keys [H, n, d], k < n, first centre =
    index 0 (the oldest entry). Returns the chosen indices [H, k] in age order and, when
    asked, every point's nearest chosen centre as an index into them [H, n].

    Each step's distances from the new centre to every point are one batched product of
    the centre's row with the points held transposed ([H, d, n]), as half squared
    distances, (|x|² + |c|²)/2 - <c, x> (halving is exact and changes no comparison).
    That costs k·n·d, against n²·d for a Gram matrix of every pair: the matrix and its
    temporaries cost 0.22 s for 1,024 centres of 3,068 points, these products 0.05 s, with
    the same centres (measured on a 2-core AMD EPYC, Zen 5).

    On the CPU, where kvchat's kernel runs (`kvchat.native.use("farthest")`), the loop
    runs there (`_farthest_native`)."""
    heads, n, _ = keys.shape
    device = keys.device
    if device.type == "cpu" and native.use("farthest"):
        steps, owner = _farthest_native(keys, k, track_owner)
        return _by_age(steps, owner)
    points = keys.float()
    half_sq = (points * points).sum(-1).mul_(0.5)
    columns = points.transpose(1, 2).contiguous()  # [H, d, n]: one product per step reads it in order
    rows = torch.arange(heads, device=device)
    # Half squared distance to the chosen set, -inf at the centres themselves: the running
    # minimum then marks chosen points, so they are never chosen again.
    nearest = torch.full((heads, n), math.inf, device=device)
    owner = torch.zeros(heads, n, dtype=torch.long, device=device) if track_owner else None
    current = torch.zeros(heads, dtype=torch.long, device=device)
    chosen = []
    distance = torch.empty(heads, 1, n, device=device)
    centre_mark = torch.tensor(-math.inf, device=device)
    for step in range(k):
        chosen.append(current)
        torch.baddbmm(half_sq.unsqueeze(1), points[rows, current].unsqueeze(1), columns, alpha=-1, out=distance)
        dist2 = distance.view(heads, n).add_(half_sq[rows, current].unsqueeze(1))
        dist2.index_put_((rows, current), centre_mark)
        if owner is not None:
            owner = torch.where(dist2 < nearest, step, owner)
        torch.minimum(nearest, dist2, out=nearest)
        current = nearest.argmax(1)
    return _by_age(torch.stack(chosen, 1), owner)


def _farthest_native(keys: Tensor, k: int, track_owner: bool) -> tuple[Tensor, Tensor | None]:
    """`farthest_first`'s loop in kvchat's kernel (`kvchat/native/_farthest.c`): the
    centres [H, k] in the order chosen and, when asked, each point's centre as a step
    [H, n]. The points go in as they are held (bf16 stays bf16: one head's points then
    stay in the core's cache from step to step), in tiles of 16 points [H, n / 16, d, 16]
    so that a step reads them in order."""
    heads, n, d = keys.shape
    points = keys.detach()
    if points.dtype not in (torch.bfloat16, torch.float32):
        points = points.float()
    tiles = -(-n // TILE)
    padded = torch.zeros(heads, tiles * TILE, d, dtype=points.dtype)
    padded[:, :n] = points
    tiled = padded.view(heads, tiles, TILE, d).transpose(2, 3).contiguous()
    chosen = torch.empty(heads, k, dtype=torch.long)
    owner = torch.empty(heads, tiles * TILE, dtype=torch.long) if track_owner else None
    native.farthest_centres(tiled, n, chosen, owner)
    return chosen, None if owner is None else owner[:, :n]


def _by_age(chosen: Tensor, owner: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Centres [H, k] chosen in step order -> in age order, and each point's centre (a step
    [H, n]) -> its index among them."""
    by_age = chosen.sort(1)
    if owner is None:
        return by_age.values, None
    steps = torch.arange(chosen.shape[1], device=chosen.device).expand_as(chosen)
    rank_of_step = torch.empty_like(by_age.indices).scatter_(1, by_age.indices, steps)
    return by_age.values, torch.gather(rank_of_step, 1, owner)


# Rows of new-entry distances computed at once (bounds the temporary [H, rows, n] block).
DISTANCE_BLOCK = 256


def _distances(rows: Tensor, points: Tensor, rows_sq: Tensor, points_sq: Tensor) -> Tensor:
    """Squared L2 distances [H, r, n] between rows [H, r, d] and points [H, n, d], float64,
    as (|a|² + |b|²) - 2<a, b> clamped at 0. This one form is used for every pair, whichever
    side computes it (a block product here, one row in `_row_distances`): a pair's distance
    does not depend on the batch that computed it, so carrying nearest neighbours across
    batches decides exactly as recomputing them. (In float64 a product of two bf16 or
    float32 numbers is exact, and for bf16 keys of realistic size so is the 64-term sum,
    in any order.)"""
    sums = rows_sq.unsqueeze(2) + points_sq.unsqueeze(1)
    return sums.sub_(torch.bmm(rows, points.transpose(1, 2)), alpha=2).clamp_min_(0)


def _row_distances(points: np.ndarray, sq: np.ndarray, row: int) -> np.ndarray:
    """`_distances` of one entry to all of one head's entries (points [n, d] float64)."""
    out = (sq[row] + sq) - 2.0 * (points @ points[row])
    return np.maximum(out, 0, out=out)


def _evict_head(
    points: np.ndarray,
    sq: np.ndarray,
    near: np.ndarray,
    partner: np.ndarray,
    new_rows: np.ndarray | None,
    first_new: int,
    surplus: int,
) -> tuple[np.ndarray, np.ndarray]:
    """One head's evictions, one at a time: the younger of the closest pair of live
    entries (ties: the lower index, i.e. the older entry, first).

    points [n, d], sq [n]: float64 keys (age order) and squared norms. near [n] / partner
    [n]: each entry's squared distance to its nearest other entry and that entry's index,
    or partner -1 when only a lower bound of the distance is known; updated in place (on
    return, a partner may be evicted: the distance is then again only a lower bound).
    new_rows [n - first_new, n]: distances of the entries from `first_new` on to all (inf
    on the diagonal), or None. Returns (alive [n] bool, absorbed_by [n]: the keeper of the
    pair that evicted each entry, itself for the others).

    A heap of (distance, index) with lazy repair: an entry whose partner is gone is only
    re-searched when it reaches the top (its stored distance, a lower bound, put it
    there). Every other entry's stored distance is exact or a lower bound, so the entry
    on top with a live partner is the closest pair among the live entries, as a full
    recomputation after every eviction would find."""
    n = near.shape[0]
    alive = [True] * n
    gone_mask = np.zeros(n)  # +inf at evicted entries, added to a row before its argmin
    absorbed = list(range(n))
    near_list, partner_list = near.tolist(), partner.tolist()
    order = np.argsort(near, kind="stable")  # a sorted list is a heap
    heap = list(zip(near[order].tolist(), order.tolist()))
    evicted = 0
    while evicted < surplus:
        dist, i = heapq.heappop(heap)
        if not alive[i] or dist != near_list[i]:
            continue  # evicted, or an outdated copy (the entry was re-searched since)
        j = partner_list[i]
        if j < 0 or not alive[j]:
            if new_rows is not None and i >= first_new:
                row = new_rows[i - first_new] + gone_mask
            else:
                row = _row_distances(points, sq, i)
                row[i] = math.inf
                row += gone_mask
            j = int(row.argmin())
            near_list[i], partner_list[i] = float(row[j]), j
            heapq.heappush(heap, (near_list[i], i))
            continue
        gone, keeper = (i, j) if i > j else (j, i)
        alive[gone] = False
        gone_mask[gone] = math.inf
        absorbed[gone] = keeper
        evicted += 1
        if keeper == i:  # i stays, its partner gone: back on the heap with a lower bound
            heapq.heappush(heap, (dist, i))
    near[:] = near_list
    partner[:] = partner_list
    return np.array(alive), np.array(absorbed)


def neighbours(
    points: Tensor, sq: Tensor, known: int, near: Tensor, partner: Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Nearest other entry of every entry [H, n] (float64 distances and indices), given
    those of the first `known` entries among themselves (exact, or partner -1 with a lower
    bound): the entries from `known` on are compared with everyone, and the earlier ones
    with them only. Returns (near, partner, new_rows): new_rows [H, n - known, n] are the
    distances of the later entries to all, kept for re-searches when they are few."""
    heads, n, _ = points.shape
    near_out = np.full((heads, n), math.inf)
    partner_out = np.full((heads, n), -1, dtype=np.int64)
    near_out[:, :known] = near.cpu().numpy()
    partner_out[:, :known] = partner.cpu().numpy()
    fresh = n - known
    kept_rows = np.empty((heads, fresh, n)) if fresh <= DISTANCE_BLOCK else None
    for first in range(known, n, DISTANCE_BLOCK):
        stop = min(first + DISTANCE_BLOCK, n)
        block = _distances(points[:, first:stop], points, sq[:, first:stop], sq).numpy()
        block[:, np.arange(stop - first), np.arange(first, stop)] = math.inf
        index = block.argmin(2)  # first occurrence: ties go to the older entry
        near_out[:, first:stop] = np.take_along_axis(block, index[..., None], 2)[..., 0]
        partner_out[:, first:stop] = index
        if known:
            # An earlier entry adopts a later one only when strictly nearer: on a tie its
            # own partner is older (and a lower bound stays one). The index is looked up
            # for those entries only (an argmin across rows is slow in NumPy).
            cross = block[:, :, :known]
            dist = cross.min(1)
            head, entry = np.nonzero(dist < near_out[:, :known])
            near_out[head, entry] = dist[head, entry]
            partner_out[head, entry] = cross[head, :, entry].argmin(1) + first
        if kept_rows is not None:
            kept_rows[:, first - known : stop - known] = block
    return near_out, partner_out, kept_rows


def evict_closest(
    keys: Tensor,
    surplus: int,
    track_owner: bool,
    known: int = 0,
    near: Tensor | None = None,
    partner: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """Per head over keys [H, n, d] (age order), evict `surplus` entries one at a time: the
    younger of the closest remaining pair. `known`, `near`, `partner`: the nearest-neighbour
    state of the first `known` entries carried from the previous batch (see `_evict_head`);
    with known = 0 everything is computed here. Returns the kept indices [H, n - surplus]
    in age order; when asked, every entry's owner among them [H, n] (a kept entry owns
    itself, an evicted one its nearest survivor at eviction time, followed through later
    evictions); and the kept entries' nearest-neighbour state (near, partner) in the kept
    entries' indices, for the next batch."""
    heads, n, _ = keys.shape
    device = keys.device
    points = keys.detach().to("cpu", torch.float64)
    sq = (points * points).sum(-1)
    empty = torch.zeros(heads, 0)
    near_all, partner_all, new_rows = neighbours(
        points, sq, known, empty if near is None else near, empty.long() if partner is None else partner
    )
    points_np, sq_np = points.numpy(), sq.numpy()
    alive = np.empty((heads, n), dtype=bool)
    absorbed = np.empty((heads, n), dtype=np.int64)
    for h in range(heads):
        alive[h], absorbed[h] = _evict_head(
            points_np[h],
            sq_np[h],
            near_all[h],
            partner_all[h],
            None if new_rows is None else new_rows[h],
            known,
            surplus,
        )
    kept = np.nonzero(alive)[1].reshape(heads, n - surplus)
    rank = np.cumsum(alive, 1) - 1  # index of each survivor among the kept
    carried = np.take_along_axis(partner_all, kept, 1)
    still = (carried >= 0) & np.take_along_axis(alive, np.maximum(carried, 0), 1)
    kept_partner = np.where(still, np.take_along_axis(rank, np.maximum(carried, 0), 1), -1)
    state = (
        torch.from_numpy(np.take_along_axis(near_all, kept, 1)).to(device),
        torch.from_numpy(kept_partner).to(device),
    )
    kept_t = torch.from_numpy(kept).to(device)
    if not track_owner:
        return kept_t, None, *state
    # Follow eviction chains to a survivor (at most `surplus` hops; usually one or two).
    owner = torch.from_numpy(absorbed).to(device)
    for _ in range(surplus):
        following = torch.gather(owner, 1, owner)
        if torch.equal(following, owner):
            break
        owner = following
    return kept_t, torch.gather(torch.from_numpy(rank).to(device), 1, owner), *state
