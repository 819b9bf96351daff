"""Interleaving model of decode_gluon_fp8's mbarrier protocol (producer warp, 2 consumers, SLOTS ring).
mbarrier: phase count c, pending arrivals, tx; wait(parity p) passes iff (c & 1) != p (PTX try_wait.parity)."""
import sys
from functools import lru_cache
sys.setrecursionlimit(100000)

def explore(n, S, in_order_tma, even_fix=False):
    # even_fix: ready barriers split per consumer parity (2*S barriers; tile t uses (slot, t % 2), phase t // (2S))
    NB = 2 * S if even_fix else S
    def rbar(t): return (t % S) + (S * (t % 2) if even_fix else 0)
    def rpar(t): return ((t // (2 * S)) if even_fix else (t // S)) & 1
    # state: prod (t, stage), cons[c] (i, stage), ready [(c, pend, tx)], free [(c, pend)], slot_content, tma_pending tuple, partial, pr_c, reading
    init = ((0, 0), ((0, 0), (0, 0)), tuple((0, 1, 0) for _ in range(NB)), tuple((0, 1) for _ in range(S)),
            tuple(-1 for _ in range(S)), (), 0, 0, ((), ()))
    errors = set()
    seen = set()
    ctiles = [list(range(c, n, 2)) for c in (0, 1)]
    last_odd = n - 1 - (n % 2)
    merge_slot = last_odd % S
    def arrive_ready(bars, b):
        c, pend, tx = bars[b]
        pend -= 1
        if pend == 0 and tx == 0: c, pend = c + 1, 1
        return bars[:b] + ((c, pend, tx),) + bars[b + 1:]
    stack = [init]
    finals = 0
    while stack:
        st = stack.pop()
        if st in seen: continue
        seen.add(st)
        prod, cons, ready, free, content, tma, partial, prc, reading = st
        succ = []
        # producer
        t, stage = prod
        if t < n:
            s = t % S
            if stage == 0:
                fc, fp = free[s]
                if (fc & 1) != (((t // S) & 1) ^ 1):
                    succ.append(((t, 1),) + st[1:])
            else:
                # expect + issue TMA
                if partial and s == merge_slot: errors.add(f"TMA tile {t} overwrites the partial")
                if any(s == (tt % S) for r in reading for tt in r): errors.add(f"TMA tile {t} into slot {s} while a consumer reads it")
                b = rbar(t)
                c, pend, tx = ready[b]
                nready = ready[:b] + ((c, pend, tx + 1),) + ready[b + 1:]
                nready = arrive_ready(nready, b)
                succ.append(((t + 1, 0), cons, nready, free, content[:s] + (-2,) + content[s + 1:], tma + (t,), partial, prc, reading))
        # TMA completions
        for k, tt in enumerate(tma):
            if in_order_tma and k > 0: break
            s = tt % S
            b = rbar(tt)
            c, pend, tx = ready[b]
            tx -= 1
            if pend == 0 and tx == 0: c, pend = c + 1, 1
            succ.append((prod, cons, ready[:b] + ((c, pend, tx),) + ready[b + 1:], free, content[:s] + (tt,) + content[s + 1:],
                         tma[:k] + tma[k + 1:], partial, prc, reading))
        # consumers
        for ci in (0, 1):
            i, stage = cons[ci]
            tl = ctiles[ci]
            def setc(new, **kw):
                nc = cons[:ci] + (new,) + cons[ci + 1:]
                vals = dict(prod=prod, cons=nc, ready=ready, free=free, content=content, tma=tma, partial=partial, prc=prc, reading=reading)
                vals.update(kw)
                return tuple(vals[k] for k in ("prod", "cons", "ready", "free", "content", "tma", "partial", "prc", "reading"))
            if i < len(tl):
                t = tl[i]; s = t % S
                if stage == 0:
                    c, pend, tx = ready[rbar(t)]
                    if (c & 1) != rpar(t):
                        if content[s] != t: errors.add(f"consumer {ci} passed ready for tile {t} but slot {s} holds {content[s]} (tma pending {tma})")
                        nr = tuple(r + ((t,) if j == ci else ()) for j, r in enumerate(reading))
                        succ.append(setc((i, 1), reading=nr))
                elif stage == 1:
                    if content[s] != t: errors.add(f"slot {s} changed under consumer {ci} tile {t}")
                    nr = tuple(() if j == ci else r for j, r in enumerate(reading))
                    fc, fp = free[s]
                    fp -= 1
                    if fp == 0: fc, fp = fc + 1, 1
                    succ.append(setc((i + 1, 0), reading=nr, free=free[:s] + ((fc, fp),) + free[s + 1:]))
            else:
                # merge
                if n <= 1:
                    if stage == 0: succ.append(setc((i, 9)))
                elif ci == 1 and stage == 0:
                    if any(tt % S == merge_slot for tt in tma): errors.add("partial written while a TMA to that slot is pending")
                    if any(tt % S == merge_slot for tt in reading[0]): errors.add("partial written while consumer 0 reads the slot")
                    succ.append(setc((i, 9), partial=1, prc=1))
                elif ci == 0 and stage == 0:
                    if prc == 1:
                        if not partial: errors.add("merge read without partial")
                        succ.append(setc((i, 9)))
        if not succ:
            done = prod[0] == n and all(c[0] == len(ctiles[j]) and c[1] in (9,) for j, c in enumerate(cons)) and not tma
            if not done: errors.add(f"DEADLOCK state {st}")
            finals += 1
        stack.extend(succ)
    return errors, len(seen)

if __name__ == "__main__":
    for fix in (False, True):
        for order in (True, False):
            for n in range(0, 13):
                errs, ns = explore(n, 5, order, fix)
                print(f"fix={fix} in_order_tma={order} n_tiles={n:2d} states={ns:7d} errors={len(errs)}", sorted(errs)[:2])
