"""Cone replay (``DSV41_SWA_CONE_REPLAY=1``): a lost SWA resume point costs N recomputed tokens.

What it changes. When a request's prefix match stops early only because the sliding window at its
resume point F (``MatchResult.swa_branching_seqlen``) was evicted while the Full KV of ``[0, F)``
is still resident, stock SGLang 0.5.23 re-prefills ``[P, L)`` from the stock match point P (often
0): 21.8-68.3 s for 130-400K-token prompts on the reference fleet. With the switch the request is
matched on Full KV up to ``s = page_floor(F - N)`` and prefills ``[s, L)``.

The package, one job a module (this module installs and holds the scheduler-side wrappers):

* :mod:`.geometry`: the bound, ``s``, a pool's window and layer count, one cache's checked config.
* :mod:`.plan`: the plan at ``UnifiedRadixCache.match_prefix`` (anchor at F's node, found by the
  Full-only ``tree_core.match_full_device_prefix`` on both tree cores; ``swa_branching_seqlen = F``
  kept, so the first checkpoint inserts exactly ``[0, F)`` and re-publishes F's window from the
  replay's SWA; one line ``DSV41_SWA_CONE plan rid=.. F=.. s=.. N=..``) and the admission rule at
  ``PrefillAdder._select_prefill_admission`` (the first prefill pass must be one chunk covering
  ``[s, F)``; a chunk cut short by the pass's earlier requests waits one pass, once:
  ``DSV41_SWA_CONE wait rid=..``; else the stock match is restored: ``DSV41_SWA_CONE fallback rid=.. reason=..``, and
  ``PrefillAdder.add_one_req`` admits the request again from the top, as stock, so that its pin
  and its commit lock are both on the stock node and the SWA it budgets is the SWA it allocates). The
  request's lock on F's node (``_commit_prefill_admission`` locks ``req.last_node``) keeps the copy
  source resident.
* :mod:`.copy`: after ``ScheduleBatch.prepare_for_extend`` wrote the rows, the resident Full-side
  KV of ``[s, F)`` is copied page by page into the replay rows' fresh pages
  (``DSV41_SWA_CONE copy rid=.. pages=.. bytes=..``).
* :mod:`.forward`: the replay rows of each batch (``ForwardBatch.init_new``), published for the
  duration of ``ModelRunner.forward``; never in a prefill CUDA graph. ``SWAKVPool``: in every
  Full-attention layer the replay rows' ``k``/``v`` become the resident Full KV of ``[s, F)``
  (``RadixAttention.forward``: SGLang's extend kernels read the extend rows' K/V from the
  forward's own tensors, so masking the cache write alone would not do it). Sliding-window layers
  are untouched and have no per-row floor: a replay row below ``s + W`` reads the evicted
  positions below s as the SWA padding slot, which changes only rows inside the cone
  (``tests/upstream/test_cone_replay_exactness.py``: bit for bit, with a floor and with padding reads).
* :mod:`.dsv4`: DeepSeek-V4 pools. Its backend stores then reads every cache, so the only forward
  field the cone needs is ``encoder_swa_compress_rows`` (the compressor / indexer writes of the
  copied rows ``[s, F - align_up(W, page) - page)`` go to slot 0). No window floor is set:
  ``encoder_swa_row_floor`` has no effect on the paged pool's main window (only the request-window
  branch and the decoder-replay tail read it), and the bound does not need one. Shown exact on
  the DSV4 and DSV4.1 kit servers (CPU: real pool, backend and tree; the kits' torch stand-ins for
  the CUDA kernels) for the V4 layout with C0/C4/C128 layers and with V4.1's ratio-1/2 KV-source
  layers, with decoder SWA bounded replay off and on (its bound then counts the layers up to the
  last KV source only); GPU kernels unverified. Refused at cache build, one line each: the
  unified KV ring, the encoder-replay request window and any other KV layout (V4.1 528-byte fp8,
  fp4, TRT-LLM uniform fp8: SM100 / gfx950 only), unless the test-only
  ``DSV41_SWA_CONE_FORWARD_STANDIN=1`` says act anyway.

It never replays inexactly: every case it cannot make exact is a one-line refusal at cache build
(a boot failure under ``DSV41_STRICT=1``), never a silent no-op.

The bound (``SWAKVPool``). A row's hidden state after k sliding-window layers depends on at most
the k*W rows before it (SGLang's window: ``r - j < W``); Full-attention layers read the copied,
exact Full KV. Rows >= F read the window ``[F - W, F)`` of every SWA layer, computed from the input
of that layer, so they are exact when ``F - s >= L_swa * W``. Rounding the first window to a page
and the total to a page gives ``align_up(align_up(W, page) + (L_swa - 1) * W, page)``, the shape of
sglang #31713's recompute window. One page more is needed: the request's first checkpoint
re-publishes the replay's own SWA KV of the last ``align_up(W, page) + page`` rows before F, and a
later request that resumes one page below F reads that extra page (measured on the real cache for
five geometries; at the bound without that page the top SWA layers are inexact in three of five exactness
cases), so ``bound = align_up(align_up(W, page) + (L_swa - 1) * W, page) + page``. DeepSeek-V4:
:func:`geometry.cone_bound_dsv4` (those re-published rows also write compressed groups, index keys
and the C4 state rings, and a C4 group pools 4 rows of the previous group: the largest per-layer
need ``align_up(W, page) + page + (4 if C4) + (k - 1) * W`` over layers k, rounded to a page; 768 on
the kit's C0/C4/C128 model, 8,192 at 61 layers when the last is not C4, 8,448 when it is; under
decoder SWA bounded replay only the layers up to the last KV source count, and the installed line
names that layer: ``decoder_tail_from=..``).

The bound is computed when the cache is built (the pools are sized from the loaded model config;
under pipeline parallelism a stage counts its own layers). At import the switch logs
``cone_replay armed N=..``; once the cache is built ``cone_replay installed N=.. bound=.. window=..
page=.. swa_layers=..``, or ``cone_replay refused: ..`` when N < bound, N is not a multiple of the
page, the pool's layout cannot be replayed exactly, or the tree has no SWA component / its SWA does
not gate the match.

Rollback: unset ``DSV41_SWA_CONE_REPLAY`` (and ``DSV41_SWA_CONE_TOKENS``).
"""

from __future__ import annotations

from typing import Any

from adapter.core import api
from adapter.switches.cone_replay import decision, hicache
from adapter.switches.cone_replay import plan as plan_mod
from adapter.switches.cone_replay.copy import copy_replay_rows
from adapter.switches.cone_replay.decision import STANDIN_KEY, TOKENS_KEY
from adapter.switches.cone_replay.forward import (
    _attention_forward,
    _can_run_graph,
    _forward_batch_init,
    _model_forward,
)
from adapter.switches.cone_replay.geometry import CACHE_ATTR, ConeConfig
from adapter.switches.cone_replay.plan import (
    ADMITTED,
    COUNTERS,
    FALLBACKS,
    LIVE,
    NO_LOAD_ATTR,
    PLANNED,
    REQ_ATTR,
    STOCK,
    WAIT,
    admit,
    fallback,
    restore_stock,
)

SWITCH = api.handle(__name__)



# -- cache build: the geometry and every refusal --------------------------------------------------
def _check_cache(cache: Any) -> ConeConfig:
    tokens = LIVE.tokens
    facts = decision.facts_of_cache(cache, tokens, LIVE.standin)
    decided = decision.decide(facts)
    cfg = ConeConfig(decided.refusal is None, tokens, decided.bound, facts.window, facts.page,
                     int(facts.swa_layers or 0), dsv4=facts.dsv4)
    if decided.refusal is not None:
        # The bound is known only once the pools exist: refuse then, as the boot would have.
        cfg.reason = decided.refusal
        SWITCH.refuse_late(decided.refusal)
        return cfg
    tail = {} if decided.tail_from is None else {"decoder_tail_from": decided.tail_from}
    host = hicache.host_full_kv(cache)
    SWITCH.confirm(N=tokens, bound=decided.bound, window=facts.window, page=facts.page, swa_layers=cfg.swa_layers,
                   **tail, **({} if host is None else {"host_full_kv": host}))
    return cfg


# -- scheduler-side wrappers ----------------------------------------------------------------------
def _cache_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    out = wrapped(*args, **kwargs)
    setattr(instance, CACHE_ATTR, _check_cache(instance))
    return out


def _match_prefix(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    result = wrapped(*args, **kwargs)
    params = args[0] if args else kwargs["params"]
    return plan_mod.plan(instance, params, result)


def _add_one_req(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    req = args[0] if args else kwargs["req"]
    plan = getattr(req, REQ_ATTR, None)
    verdict = wrapped(*args, **kwargs)
    if plan is not None and plan.state == STOCK:
        # The admission fell back (``_select_admission`` restored the stock match and committed
        # nothing): admit it again from the top, as stock admits the stock match. add_one_req pins
        # ``req.last_node`` for the selection and commit locks it: the first pass pinned F's node,
        # so a stock selection under it would count the stock node's SWA window as evictable, then
        # lock it at commit, and the batch's allocation would find less SWA than was budgeted.
        return wrapped(*args, **kwargs)
    return verdict


def _select_admission(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    req = args[0] if args else kwargs["req"]
    plan = getattr(req, REQ_ATTR, None)
    if plan is None or plan.state != PLANNED or req.prefix_len != plan.s:
        return wrapped(*args, **kwargs)
    admission = wrapped(*args, **kwargs)
    if not hasattr(admission, "extend_len"):  # not admitted this round: matched again next round
        return admission
    if kwargs.get("host_hit_length") or kwargs.get("swa_host_hit_length"):
        # The plan zeroes the host hit; a caller that still passes one would queue a load-back
        # beside the replay: never replay then.
        fallback(req, "host_load_back", F=plan.F, s=plan.s)
        restore_stock(req, plan)
    elif (verdict := admit(req, admission.prefix_len, admission.extend_len, bool(instance.can_run_list))) == WAIT:
        # Nothing committed, the plan kept: the scheduler stops adding requests this pass; the
        # request stays waiting and is matched and admitted again on a later pass.
        return _add_req_result().OTHER
    elif verdict == ADMITTED:
        if not plan.load:
            return admission
        why = hicache.load_full_kv(instance, req, plan, admission.extend_len, admission.max_new_tokens)
        if why is None:
            return admission
        # HiCache cannot give the pages: stock (with its own load-back, if any), once per request.
        setattr(req, NO_LOAD_ATTR, plan.F)
        fallback(req, why, F=plan.F, s=plan.s, load=plan.load)
        restore_stock(req, plan)
    # Nothing selected under this pin (F's node): _add_one_req admits the stock match from the top.
    return _add_req_result().OTHER


def _add_req_result() -> Any:
    return __import__(SWITCH.module_of("PrefillAdder.add_one_req"), fromlist=["AddReqResult"]).AddReqResult


def _prepare_for_extend(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    out = wrapped(*args, **kwargs)
    for req in instance.reqs:
        plan = getattr(req, REQ_ATTR, None)
        if plan is None or plan.state != ADMITTED:
            continue
        if req.prefix_len == plan.s:
            if plan.load:  # the loaded pages land on the controller's stream
                hicache.wait_loaded(instance)
            copy_replay_rows(instance.tree_cache, instance.req_to_token_pool.req_to_token, req.kv.req_pool_idx, plan)
        else:  # not the pass it was admitted for (retracted and re-matched): no replay
            setattr(req, REQ_ATTR, None)
    return out


def install(ctx: api.SwitchContext) -> dict[str, Any]:
    SWITCH.bind(ctx)
    tokens = int(ctx.option(TOKENS_KEY))
    if tokens <= 0:
        raise api.Refusal(f"{TOKENS_KEY}={tokens} must be positive")
    LIVE.tokens = tokens
    LIVE.standin = bool(ctx.option(STANDIN_KEY))
    for target, wrapper in (
        ("UnifiedRadixCache.__init__", _cache_init),
        ("UnifiedRadixCache.match_prefix", _match_prefix),
        ("PrefillAdder.add_one_req", _add_one_req),
        ("PrefillAdder._select_prefill_admission", _select_admission),
        ("ScheduleBatch.prepare_for_extend", _prepare_for_extend),
        ("ForwardBatch.init_new", _forward_batch_init),
        ("RadixAttention.forward", _attention_forward),
        ("PrefillCudaGraphRunner.can_run_graph", _can_run_graph),
        ("ModelRunner.forward", _model_forward),
        ("UnifiedTreeCore.build_load_back_spec", hicache._build_load_back_spec),
        ("SWAComponent.build_hicache_transfers", hicache._swa_transfers),
    ):
        ctx.wrap(target, wrapper)
    ctx.decide_later()  # installed or refused once a cache is built and its geometry is known
    return {"N": tokens}


def reset_counters() -> None:
    COUNTERS.reset()
    FALLBACKS.clear()
    LIVE.reset_flight()


