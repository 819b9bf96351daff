"""Program-order model of mla_decode_few_rows_fp8's handshakes after the QK(t)/PV(t-1) overlap.

Actors: TMA (units complete in any order), converter partition, MMA partition (one actor: its
barriers make the four warps agree at every point modeled), tensor cores (wgmma groups complete
in issue order, any time after issue). Slots, phases and issue ranges are the kernel's formulas.
Checks: no deadlock; no unit issued twice; no fp8 half slot / rope slot overwritten before it was
converted; no f16 tile written while a wgmma group reading it is in flight or before its reads
were issued; every wgmma reads the tile (and P^T) it should; P^T not overwritten while PV reads it.
"""

import random


class Bar:
    def __init__(self):
        self.completions = 0

    def passed(self, parity):  # try_wait.parity(P) succeeds once the phase with parity P completed
        return (self.completions & 1) != parity


class Fail(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Fail(msg)


def run(n_tiles, S, R, rnd, mutation=None):
    ready = [Bar() for _ in range(S)]
    conv = [Bar(), Bar()]
    free = [Bar(), Bar()]
    slot_unit = [None] * S  # [unit, converted]
    rope_tile = [None] * R
    f16 = [None, None]  # tile held by f16 buffer b (None while being written)
    p_tile = [None]  # tile whose P^T is in p_buf
    groups = []  # wgmma groups in flight, in issue order: list of (buffer reads)
    inflight = []
    issued = set()

    def reads_of(kind, key):
        return [g for g in groups if (kind, key) in g]

    def issue(first, limit):
        for u in range(first, limit):
            check(u not in issued, f"unit {u} issued twice")
            issued.add(u)
            slot = u % S
            check(
                slot_unit[slot] is None or slot_unit[slot][1],
                f"slot {slot} refilled before converted (unit {u})",
            )
            slot_unit[slot] = [u, False]
            if u % 2 == 0:
                t = u // 2
                rs = t % R
                check(rope_tile[rs] is None or rope_tile[rs][1], f"rope slot {rs} refilled early (tile {t})")
                rope_tile[rs] = [t, False]
            inflight.append(u)
            yield

    def converter():
        yield from issue(0, min(S, 2 * n_tiles))
        for t in range(n_tiles):
            b = t % 2
            par = ((t // 2) & 1) ^ 1
            if mutation == "free_parity":
                par = (t // 2) & 1
            while not free[b].passed(par):
                yield "blocked"
            while not ready[(2 * t) % S].passed(((2 * t) // S) & 1):
                yield "blocked"
            # writing f16 tile b (rope box and low half)
            check(not reads_of("k", b), f"f16 tile {b} written (tile {t}) while a wgmma reads it")
            check(
                t < 2 or f16[b] == t - 2 and consumed.get(t - 2),
                f"f16 tile {b} overwritten before tile {t - 2}'s products were issued",
            )
            f16[b] = None
            su = slot_unit[(2 * t) % S]
            check(su[0] == 2 * t, f"converter read unit {su[0]} for {2 * t}")
            rt = rope_tile[t % R]
            check(rt[0] == t, f"converter read rope of tile {rt[0]} for {t}")
            yield
            check(not reads_of("k", b), f"f16 tile {b} written (tile {t}) while a wgmma reads it")
            rt[1] = True
            su[1] = True
            yield from issue(min(2 * t + S, 2 * n_tiles), min(2 * t + 1 + S, 2 * n_tiles))
            while not ready[(2 * t + 1) % S].passed(((2 * t + 1) // S) & 1):
                yield "blocked"
            su2 = slot_unit[(2 * t + 1) % S]
            check(su2[0] == 2 * t + 1, f"converter read unit {su2[0]} for {2 * t + 1}")
            check(not reads_of("k", b), f"f16 tile {b} written (tile {t}) while a wgmma reads it")
            yield
            check(not reads_of("k", b), f"f16 tile {b} written (tile {t}) while a wgmma reads it")
            su2[1] = True
            f16[b] = t
            conv[b].completions += 1
            yield from issue(min(2 * t + 1 + S, 2 * n_tiles), min(2 * t + 2 + S, 2 * n_tiles))

    consumed = {}  # tile -> both products issued (QK done earlier, PV issued)

    def wgmma(reads_k_tile=None, reads_p_tile=None):
        g = set()
        if reads_k_tile is not None:
            b = reads_k_tile % 2
            check(
                f16[b] == reads_k_tile, f"wgmma reads f16 tile {b} holding {f16[b]} for tile {reads_k_tile}"
            )
            g.add(("k", b))
        if reads_p_tile is not None:
            check(p_tile[0] == reads_p_tile, f"PV reads P^T of {p_tile[0]} for tile {reads_p_tile}")
            g.add(("p", 0))
        groups.append(g)

    def wait_groups(k):
        while len(groups) > k:
            yield "blocked"

    def store_p(t):
        check(not reads_of("p", 0), f"P^T({t}) stored while PV reads P^T")
        p_tile[0] = t

    def mma():
        if n_tiles > 0:
            while not conv[0].passed(0):
                yield "blocked"
            for _ in range(3):
                wgmma(reads_k_tile=0)
            yield from wait_groups(0)
            yield
            store_p(0)
            yield
        for t in range(1, n_tiles):
            prev, b = (t - 1) % 2, t % 2
            par = (t // 2) & 1
            if mutation == "conv_parity":
                par ^= 1
            wgmma(reads_k_tile=t - 1, reads_p_tile=t - 1)
            wgmma(reads_k_tile=t - 1, reads_p_tile=t - 1)
            consumed[t - 1] = True
            yield
            if mutation == "arrive_early":
                free[prev].completions += 1
            while not conv[b].passed(par):
                yield "blocked"
            for _ in range(3):
                wgmma(reads_k_tile=t)
            yield
            yield from wait_groups(
                0 if mutation == "wait_all" else (4 if mutation == "wait_one_short" else 3)
            )
            if mutation != "arrive_early":
                free[prev].completions += 1
            yield
            yield from wait_groups(0)
            yield
            store_p(t)
            yield
        if n_tiles > 0:
            wgmma(reads_k_tile=n_tiles - 1, reads_p_tile=n_tiles - 1)
            wgmma(reads_k_tile=n_tiles - 1, reads_p_tile=n_tiles - 1)
            consumed[n_tiles - 1] = True
            yield from wait_groups(0)

    def tma_step():
        u = inflight.pop(rnd.randrange(len(inflight)))
        ready[u % S].completions += 1

    actors = {"conv": converter(), "mma": mma()}
    done = set()
    idle_rounds = 0
    while len(done) < 2:
        choices = [a for a in actors if a not in done]
        if inflight:
            choices.append("tma")
        if groups:
            choices.append("tc")
        pick = rnd.choice(choices)
        if pick == "tma":
            tma_step()
            idle_rounds = 0
            continue
        if pick == "tc":
            groups.pop(0)
            idle_rounds = 0
            continue
        try:
            r = next(actors[pick])
            idle_rounds = idle_rounds + 1 if r == "blocked" else 0
        except StopIteration:
            done.add(pick)
            idle_rounds = 0
        if idle_rounds > 200 and not inflight and not groups:
            raise Fail(f"deadlock: conv/mma blocked (n_tiles {n_tiles})")
    check(not inflight, "TMA loads left in flight at exit")
    check(len(issued) == 2 * n_tiles, f"issued {len(issued)} units of {2 * n_tiles}")
    check(all(consumed.get(t) for t in range(n_tiles)), "a tile's PV never issued")


def n_tiles_of(seq_len, splits, split):
    chunk = -(-(-(-seq_len // splits)) // 64) * 64
    start = split * chunk
    end = min(start + chunk, seq_len)
    return -(-max(end - start, 0) // 64)


def sweep(mutation=None, seeds=400):
    for S, R in [(3, 2), (2, 1)]:
        for n in range(0, 9):
            for seed in range(seeds):
                run(n, S, R, random.Random(seed * 1000 + n * 10 + S), mutation)


if __name__ == "__main__":
    # the n_tiles the GPU tests produce (seq_lens x splits), all within 0..8 or covered by the sweep's shape
    tiles = sorted(
        {n_tiles_of(s, k, i) for s in (0, 1, 63, 64, 65, 700, 4113) for k in (1, 2, 3) for i in range(k)}
    )
    print("n_tiles in the GPU tests' cases:", tiles)
    sweep()
    for n in (20, 65):
        for S, R in [(3, 2), (2, 1)]:
            for seed in range(40):
                run(n, S, R, random.Random(seed), None)
    print("correct protocol: no failure (n_tiles 0-8 x 400 interleavings x rings (3,2),(2,1); 20, 65 x 40)")
    for mut in ["free_parity", "conv_parity", "arrive_early", "wait_one_short"]:
        try:
            sweep(mut, seeds=60)
            print(f"mutation {mut}: NOT caught")
        except Fail as e:
            print(f"mutation {mut}: caught: {e}")
    sweep("wait_all", seeds=60)
    print("mutation wait_all (PV and QK both waited before the hand-back): still correct, as it should be")
