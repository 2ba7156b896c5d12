#!/usr/bin/env python3
"""End-to-end benchmark: DDP training step time, bytes per step and loss, by model, hook and network.

What it measures
----------------
W worker processes (default 4; CPU, Gloo process group, ``torch.set_num_threads(1)`` each) train
one model with ``DistributedDataParallel`` for ``--steps`` steps, once per (model, hook, network):

Models
    ``recsys``: the DLRM-style recommender of examples/train_recsys.py (``Recommender``, 26 tables,
    1,045,760 rows of 16 floats; batches from its ``make_batch``, 256 rows per rank).

    ``lstm``: a word-level LSTM language model (``WordLM``, :func:`build_word_lm`): a 100,000 x 256
    embedding, one LSTM layer (hidden 256), and a decoder to the vocabulary, trained on a synthetic
    Zipf token stream generated here (:func:`make_lm_batch`; 16 sequences of 32 tokens per rank).

    ``mlp``: a dense model, every bucket dense (:func:`build_mlp`): ``--mlp-layers`` (4) Linear
    layers, ``--mlp-width`` (1024) wide with GELUs between them (not ReLUs: a unit dead for a whole
    batch would zero its weights' gradient rows), from ``--mlp-width`` inputs to one output (3.1M
    parameters, 12 MB of gradients with the defaults), regressing a fixed random teacher
    (``y = tanh(x A) b``, A 1024 x 64, the same on every rank and run, scaled so that y has about
    unit variance) on Gaussian inputs (:func:`make_mlp_batch`; 64 rows per rank, mean squared
    error). Every gradient element is non-zero every step (union density 1): the communication
    is a plain dense all-reduce, whatever the hook.

    All three train with ``Adam(lr=1e-3, fused=True)`` (the fused CPU kernel: the default foreach Adam
    spends ~270 ms per step on the LM's 26M parameters on one core of the development VM, which
    would drown the communication being compared).

    ``recsys-sparse`` and ``lstm-sparse``: the same models with ``sparse=True`` tables (the LM's
    decoder looks its rows up with ``embedding(..., sparse=True)`` too), so their gradients are
    sparse COO tensors: DDP's default reduces them with Gloo's sparse all-reduce (an all-gather of
    every rank's rows), omnireduce's hook by rows. Adam takes no sparse gradients, so the tables
    train with ``SparseAdam`` (lazy: only the touched rows' moments move) and the rest with Adam:
    their loss curves differ from the dense models' (but not between hooks).

    Decoder: weight tying *and* a sampled softmax. Weight tying alone does not keep the gradient
    sparse: with a full softmax every vocabulary word gets a non-zero probability, so the decoder
    gradient touches every row, and a tied table then has a fully dense gradient (a separate dense
    100k x 256 decoder would add a dense 100 MB gradient to every step). A sampled softmax
    (Jean et al. 2015) scores each position against its true next word and ``--lm-negatives``
    (1024) candidates drawn with replacement from the log-uniform (Zipfian) proposal
    ``Q(k) = log((k+2)/(k+1)) / log(V+1)`` (word ids are frequency ranks), with the usual
    ``log(K Q(k))`` correction and accidental hits masked out. Only the rows of the batch's input
    and target words and of the sampled candidates get gradient (about 890 of the 100,000 rows per
    rank and step with the defaults, ~3 % in the union of 4 ranks); the rest stays exactly zero.
    Tying on top of that halves the parameters (one table instead of two) and makes the input and
    output rows coincide. Each rank and step draws its own candidates (as a real data-parallel job
    would). The decoder bias (100k floats) is sparse per element, but its non-zeros are scattered
    over nearly all of its 256-element blocks: omnireduce's dense fallback all-reduces the DDP
    bucket that holds it (with the LSTM's recurrent weights; ~2 MB of the ~4 MB per step).
    The reported LM loss is the sampled-softmax loss (comparable across settings, since every
    setting sees the same tokens and candidates; not a full-softmax perplexity).

    The token stream: word ids are frequency ranks; each sequence starts with a Zipf(1.0) draw over
    the vocabulary, and each next word is, with probability 1/2, a fixed "successor" of the
    current word (a table drawn once from the same Zipf law) and otherwise a fresh Zipf draw, so
    there is something to learn beyond unigram frequencies and the loss goes down.

Hooks (communication settings)
    ``allreduce``: DDP's default (no hook; Gloo all-reduce of each bucket).
    ``omnireduce``: ``omnireduce.ddp.omnireduce_hook`` with a default ``OmniReduceState`` (block 256,
    each dense bucket's path, omnireduce or Gloo's all-reduce, chosen by timing both for its first 8
    calls after DDP's bucket rebuild: ``path="measure"``), ``--aggregators`` (1) ``omnireduce-agg``
    processes. With ``--warmup`` >= 12 the measuring steps (2 to ~10) fall inside the warm-up.
    ``omnireduce-threshold``: the same with ``OmniReduceState(path="threshold")``: the rule before
    measuring, a bucket goes dense once its union density reaches 0.6. The row of every omnireduce
    hook holds, under ``omnireduce``, the knob (``path``), each bucket's agreed path and both paths'
    agreed times with ``measure`` (``paths``: ``stats()["paths"]``), and the buckets each step sent
    dense and through omnireduce (``buckets_per_step``).
    ``omnireduce-unaligned``: the same with ``OmniReduceState(align_blocks=False)``: every dense
    bucket on the fixed grid of 256 elements (the default aligns a bucket's blocks to the rows of
    its dominant table).
    ``omnireduce-collective``: the same with ``OmniReduceState(engine="collective")``: the ranks sum
    each other's blocks through the process group (``omnireduce.engines.collective``), no aggregator sums.
    ``fp16``: ``fp16_compress_hook`` (cast each bucket to float16, all-reduce, cast back).
    ``powersgd``: ``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=2,
    start_powerSGD_iter=2, min_compression_rate=2, use_error_feedback=True, warm_start=True,
    random_seed=<seed>)``. 2 is the smallest start iteration torch allows with error feedback; the
    first two steps are plain all-reduces and fall inside the warm-up when ``--warmup >= 2``.
    min_compression_rate 2 (torch's default) leaves biases and other small tensors uncompressed. On
    Gloo, torch's hook as it is mismatches collectives across ranks when several buckets are in
    flight (it aborted or hung here; see ``ombench.hooks.SerialHookState``), so it runs
    wrapped: each bucket's PowerSGD starts when the previous bucket's has finished (still overlapped
    with the rest of the backward pass, but no longer with the other buckets' PowerSGD).

Networks
    ``loopback``: every process in the root network namespace on this machine, Gloo and the
    aggregator on 127.0.0.1 (a free port).
    ``1gbit`` (or any tc rate such as ``10gbit``, ``100mbit``): the emulated network of
    ``ombench.netem``: one namespace per worker and per aggregator on one bridge, every
    link shaped to the rate both ways (tbf).
    ``omnireduce-agg --listen tcp://<aggregator address>:5555 --insecure`` runs in the aggregator
    namespace; worker i runs in its namespace with RANK, WORLD_SIZE, MASTER_ADDR (worker 0's
    address), MASTER_PORT, GLOO_SOCKET_IFNAME (the namespace's interface) and OMNIREDUCE_AGGREGATORS
    set. The cluster is torn down (processes killed, namespaces deleted) when the network's settings
    are done, on errors, Ctrl-C and SIGTERM. It needs root; asking for it without root fails at once
    with the reason.

    Either way every worker and aggregator shares this machine's CPUs (2 cores on the development
    VM for 4 workers + 1 aggregator): loopback step times are mostly CPU time, the emulated network
    adds the bandwidth limit but not more cores, and other load on the machine shows up in the
    times. Run nothing else meanwhile.

Every (model, hook, network) runs in fresh worker processes with the same seed, the same model
initialisation and the same data (batches depend only on rank, step and seed), so loss curves are
comparable: ``allreduce`` and ``omnireduce`` agree up to float rounding (Gloo's ring and the
aggregator sum in different orders); ``fp16`` and ``powersgd`` are lossy and differ.

Reported per setting
    * median step time: a step is zero_grad + forward + backward (with the hook's communication)
      + optimizer step, timed on every rank (batch generation excluded); a step's time is the
      slowest rank's; the median is over the steps after ``--warmup``.
    * MB sent per step per worker (MB = 2**20 bytes), mean over the timed steps (and ranks):
        - allreduce: ``2 (W-1)/W * G``, G = gradient bytes (all float32 parameters): what each rank
          sends in a ring all-reduce;
        - fp16: ``2 (W-1)/W * G / 2``;
        - powersgd: ``2 (W-1)/W * 4 * (U + sum over compressed tensors of (n + m) * r)`` once
          compressing, where each gradient tensor is viewed as an n x m matrix (n = its first
          dimension, m = the rest), r = min(n, m, 2), and it is compressed iff
          ``(n + m) * r * min_compression_rate < n * m``; U is the element count of the tensors
          that are not (biases and other small ones), which are all-reduced as they are. P (n x r)
          and Q (m x r) are each all-reduced once per step, in float32. Steps before
          start_powerSGD_iter count as ``allreduce``;
        - omnireduce: what the hook actually sent, from ``state.stats()["bytes_sent"]`` (non-zero
          blocks to the aggregators, plus any dense-fallback bucket counted at the ring formula).
      All but omnireduce's are formulas, not measurements (Gloo's own algorithm may differ from a
      ring; the emulated network's headers are not counted either).
      As a cross-check the JSON also holds ``counted_mb_per_step``: the ring formula applied to the
      tensors the hooks passed to ``torch.distributed.all_reduce`` (fp16 and PowerSGD; DDP's own
      all-reduce runs in C++ and is not seen, omnireduce's sparse traffic does not use it).
    * the loss after N steps: the mean over the last 10 steps of the loss averaged over ranks.
    * the 1-minute load average of the machine before and after the setting (``loadavg_1min``; the
      meta has it at the start and end of the run): other jobs on the cores show up in the times.
    * CPU ms per step and worker: the process's CPU time (all its threads: omnireduce's I/O thread,
      Gloo's) over the timed part of a step, mean over ranks and timed steps; for omnireduce, the
      aggregators' CPU (``/proc``) over the whole setting divided by the steps.
    * sparse models with ``allreduce``: MB per step is the ring formula for the dense buckets plus
      ``(W-1)/W`` of all ranks' coalesced rows (8-byte index + row; counted from the batch), what
      each rank sends in Gloo's all-gather of the rows, on average.

Output: a table on stdout, a JSON file (``--json``: every row with per-step times, losses and
bytes, and metadata: machine, versions, W, steps, model sizes, hook and network parameters; it is
rewritten after every setting) and a PNG (``--plot``): median step time per hook, grouped by
network, one panel per model, with each setting's loss curve below (if matplotlib is installed:
``make bench`` installs it).

    python scripts/bench_train.py                                   # everything (needs root for 1gbit)
    python scripts/bench_train.py --models recsys --nets loopback --steps 6 --warmup 2
    python scripts/bench_train.py --models lstm --hooks allreduce,omnireduce --nets 1gbit

Nodes of several ranks (scripts/bench_hierarchy.py runs this script's settings on a ``Network``
with ``ranks_per_node``): each rank gets its node's environment (``Network.rank_env``), and where a
node has a link to count (``$OMBENCH_LINK``) the row's ``link`` holds the bytes that crossed each
node's link per timed step (interface counters, read after a barrier before the first timed step
and after the last: :mod:`ombench.linkbytes`).

A setting that fails (a worker exits non-zero or it passes ``--setting-timeout``) is recorded with
its error, its processes are killed and the benchmark goes on; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import inspect
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ombench import linkbytes, netem, plots, tables
from ombench.hooks import HOOKS, POWERSGD, HookSetup
from ombench.machine import machine_info
from ombench.network import Network, exit_on_signals, print_log_tails
from ombench.traffic import ring_bytes

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("recsys", "lstm", "recsys-sparse", "lstm-sparse", "mlp")
DEFAULT_MODELS = ("recsys", "lstm")
# run by default; --hooks also accepts the others of HOOKS: the optimizer fused into the hook (fuse_optimizer)
DEFAULT_HOOKS = ("allreduce", "omnireduce", "fp16", "powersgd")
LAST_N = 10  # the reported loss is the mean of the last LAST_N steps
AGG_PORT = 5555


# ------------------------------------------------------------------------------------------------
# data and the language model (imported by the worker processes only: they need torch)


def zipf_cdf(vocab: int, exponent: float) -> np.ndarray:
    """Cumulative distribution of a Zipf law truncated to ``vocab`` words (id k has weight 1/(k+1)^s)."""
    w = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** exponent
    cdf = np.cumsum(w)
    return cdf / cdf[-1]


def make_lm_batch(rank: int, step: int, batch: int, seq: int, vocab: int, negatives: int, seed: int,
                  exponent: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, candidates)``: ``batch`` sequences of ``seq + 1`` word ids and the sampled-softmax candidates.

    Depends only on its arguments (the same data for every hook and network). Tokens: a Zipf first
    word, then with probability 1/2 the current word's fixed successor, else a fresh Zipf draw.
    Candidates: ``negatives`` ids drawn with replacement from the log-uniform proposal.
    """
    cdf = _cached_cdf(vocab, exponent)
    successor = _cached_successor(vocab, exponent)
    rng = np.random.default_rng([seed, rank, step, 11])
    draws = np.minimum(np.searchsorted(cdf, rng.random((batch, seq + 1))), vocab - 1)
    follow = rng.random((batch, seq + 1)) < 0.5
    tokens = np.empty((batch, seq + 1), dtype=np.int64)
    tokens[:, 0] = draws[:, 0]
    for t in range(1, seq + 1):
        tokens[:, t] = np.where(follow[:, t], successor[tokens[:, t - 1]], draws[:, t])
    # log-uniform sampler (as TensorFlow's): k = floor(exp(u log(V+1))) - 1
    cand = np.floor(np.exp(rng.random(negatives) * math.log(vocab + 1))).astype(np.int64) - 1
    return tokens, np.clip(cand, 0, vocab - 1)


_CACHE: dict[tuple[str, int, float], np.ndarray] = {}


def _cached_cdf(vocab: int, exponent: float) -> np.ndarray:
    key = ("cdf", vocab, exponent)
    if key not in _CACHE:
        _CACHE[key] = zipf_cdf(vocab, exponent)
    return _CACHE[key]


def _cached_successor(vocab: int, exponent: float) -> np.ndarray:
    key = ("succ", vocab, exponent)
    if key not in _CACHE:
        hidden = np.random.default_rng(4242)  # the same table on every rank, step and run
        _CACHE[key] = np.minimum(np.searchsorted(_cached_cdf(vocab, exponent), hidden.random(vocab)), vocab - 1)
    return _CACHE[key]


def build_word_lm(vocab: int, dim: int, sparse: bool = False) -> Any:
    """The :class:`WordLM` module (defined here so that the orchestrator never imports torch); with
    ``sparse``, the tied table's gradient is a sparse COO tensor (its lookups, the input words' and
    the decoder's, are ``embedding(..., sparse=True)``)."""
    import torch
    from torch import nn
    from torch.nn import functional

    class WordLM(nn.Module):
        """Embedding -> 1-layer LSTM -> sampled softmax over the tied embedding (+ a bias per word)."""

        def __init__(self) -> None:
            super().__init__()
            self.vocab = vocab
            self.embedding = nn.Embedding(vocab, dim, sparse=sparse)
            self.lstm = nn.LSTM(dim, dim, num_layers=1, batch_first=True)
            self.bias = nn.Parameter(torch.zeros(vocab))
            nn.init.uniform_(self.embedding.weight, -0.1, 0.1)

        def log_expected(self, ids: torch.Tensor, k: int) -> torch.Tensor:
            """log(K Q(id)), Q the log-uniform proposal: the sampled-softmax correction."""
            q = torch.log1p(1.0 / (ids.to(torch.float32) + 1.0)) / math.log(self.vocab + 1)
            return torch.log(k * q)

        def forward(self, tokens: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
            inputs, targets = tokens[:, :-1], tokens[:, 1:].reshape(-1)
            h, _ = self.lstm(self.embedding(inputs))
            h = h.reshape(-1, h.shape[-1])
            w = self.embedding.weight  # tied decoder
            k = candidates.numel()
            w_true = functional.embedding(targets, w, sparse=True) if sparse else w[targets]
            w_neg = functional.embedding(candidates, w, sparse=True) if sparse else w[candidates]
            true = (h * w_true).sum(1) + self.bias[targets] - self.log_expected(targets, k)
            neg = h @ w_neg.t() + self.bias[candidates] - self.log_expected(candidates, k)
            neg = neg.masked_fill(candidates.unsqueeze(0) == targets.unsqueeze(1), -1e9)  # accidental hits
            logits = torch.cat([true.unsqueeze(1), neg], dim=1)
            return functional.cross_entropy(logits, torch.zeros_like(targets))

    return WordLM()


def make_mlp_batch(rank: int, step: int, batch: int, features: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: ``batch`` Gaussian inputs of ``features`` floats and the teacher's targets
    ``tanh(x A) b`` (A ``features`` x 64 and b fixed: the same on every rank, step and run; the
    inputs depend only on the arguments)."""
    key = ("teacher", features, 64.0)
    if key not in _CACHE:
        hidden = np.random.default_rng(4243)
        _CACHE[key] = hidden.standard_normal((features, 64)).astype(np.float32) / math.sqrt(features)
        _CACHE[("teacher-out", features, 64.0)] = hidden.standard_normal((64, 1)).astype(np.float32) / 5.0
    a, b = _CACHE[key], _CACHE[("teacher-out", features, 64.0)]
    x = np.random.default_rng([seed, rank, step, 13]).standard_normal((batch, features)).astype(np.float32)
    return x, np.tanh(x @ a) @ b


def build_mlp(width: int, layers: int) -> Any:
    """``layers`` Linear layers (``width`` inputs, ``width`` wide, one output) with GELUs between them."""
    from torch import nn

    modules: list[Any] = []
    for i in range(layers):
        modules.append(nn.Linear(width, 1 if i == layers - 1 else width))
        if i < layers - 1:
            modules.append(nn.GELU())
    return nn.Sequential(*modules)


# ------------------------------------------------------------------------------------------------
# one worker process


def _example(name: str) -> Any:
    """The module ``examples/<name>.py`` (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def worker_main(cfg: dict[str, Any]) -> None:
    """Train ``cfg["model"]`` with ``cfg["hook"]`` for ``cfg["steps"]`` steps; rank 0 writes ``cfg["out"]``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from omnireduce.launch import init_distributed
    from omnireduce.lifetime import exit_with_parent

    exit_with_parent()  # SIGTERM when the benchmark is gone (Network.run_ranks: stdin is a pipe from it)
    torch.set_num_threads(1)
    rank, world = init_distributed("gloo")
    torch.manual_seed(cfg["seed"])
    steps, warmup = cfg["steps"], cfg["warmup"]

    sparse = cfg["model"].endswith("-sparse")
    if cfg["model"].startswith("recsys"):
        recsys = _example("train_recsys")
        module = recsys.Recommender()
        for table in module.tables:
            table.sparse = sparse
        bce = nn.BCEWithLogitsLoss()
        embedding_rows, row_floats = sum(recsys.TABLE_ROWS), 16

        def batch_for(step: int) -> tuple[torch.Tensor, ...]:
            return recsys.make_batch(rank, step, cfg["recsys_batch"], cfg["recsys_zipf"])

        def touched(b: tuple[torch.Tensor, ...]) -> list[tuple[int, int]]:
            """(rows touched, row width) of each table's gradient in this step."""
            return [(int(torch.unique(b[1][:, i]).numel()), 16) for i in range(b[1].shape[1])]

        def loss_of(model: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
            dense, ids, label = b
            return bce(model(dense, ids), label)
    elif cfg["model"] == "mlp":
        module = build_mlp(cfg["mlp_width"], cfg["mlp_layers"])
        mse = nn.MSELoss()
        embedding_rows, row_floats = 0, 0

        def batch_for(step: int) -> tuple[torch.Tensor, ...]:
            x, y = make_mlp_batch(rank, step, cfg["mlp_batch"], cfg["mlp_width"], cfg["seed"])
            return torch.from_numpy(x), torch.from_numpy(y)

        def touched(b: tuple[torch.Tensor, ...]) -> list[tuple[int, int]]:
            return []  # (no sparse gradients)

        def loss_of(model: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return mse(model(b[0]), b[1])
    else:
        module = build_word_lm(cfg["vocab"], cfg["lm_dim"], sparse)
        embedding_rows, row_floats = cfg["vocab"], cfg["lm_dim"]

        def touched(b: tuple[torch.Tensor, ...]) -> list[tuple[int, int]]:
            return [(int(torch.unique(torch.cat([b[0].reshape(-1), b[1]])).numel()), cfg["lm_dim"])]

        def batch_for(step: int) -> tuple[torch.Tensor, ...]:
            tokens, cand = make_lm_batch(rank, step, cfg["lm_batch"], cfg["lm_seq"], cfg["vocab"],
                                         cfg["lm_negatives"], cfg["seed"])
            return torch.from_numpy(tokens), torch.from_numpy(cand)

        def loss_of(model: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
            return model(*b)

    # buffers are constants here: no per-step broadcast (it would add a collective to every step)
    sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters \
        else "broadcast_buffers"
    model = DistributedDataParallel(module, gradient_as_bucket_view=True, **{sync: False})
    params = [p for p in model.parameters() if p.requires_grad]
    sparse_params = [p for m in module.modules() if getattr(m, "sparse", False) for p in m.parameters()]
    dense_params = [p for p in params if all(p is not q for q in sparse_params)]
    try:  # the fused CPU kernel: foreach Adam spends ~270 ms per step on the LM's 26M parameters here
        opt = torch.optim.Adam(dense_params, lr=cfg["lr"], fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.Adam(dense_params, lr=cfg["lr"])
    # Adam takes no sparse gradients: the sparse tables get SparseAdam (lazy: only touched rows move)
    opts = [opt] + ([torch.optim.SparseAdam(sparse_params, lr=cfg["lr"])] if sparse_params else [])
    if sparse_params and cfg["hook"].endswith("-fused"):
        raise SystemExit("bench_train: the -fused hooks take one optimizer; sparse models have two")
    setup = HookSetup(model=model, optimizer=opt, params=params, world=world, seed=cfg["seed"])
    comm = HOOKS[cfg["hook"]](setup)

    # cross-check: count what hooks hand to dist.all_reduce (Python-level calls only)
    counted = [0.0]
    original_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        counted[0] += ring_bytes(tensor.numel() * tensor.element_size(), world)
        return original_all_reduce(tensor, *a, **k)

    dist.all_reduce = counting_all_reduce

    times, losses, sent, seen, cpu, rows_bytes = [], [], [], [], [], []
    link = linkbytes.link_name()  # nodes on the emulated network: count what crosses this node's link
    link_start = None
    for step in range(steps):
        if link and step == warmup:  # every rank is done with the warm-up: the timed steps' bytes from here
            dist.barrier()
            link_start = linkbytes.read(link)
        b = batch_for(step)
        # this rank's coalesced sparse gradients: rows x (8-byte index + row) (for the allgather formula)
        rows_bytes.append(sum(n * (8 + 4 * d) for n, d in touched(b)) if sparse else 0)
        comm.begin_step()
        counted_before = counted[0]
        c0 = time.process_time()  # every thread of the process: the I/O thread and Gloo's too
        t0 = time.perf_counter()
        for o in opts:
            o.zero_grad(set_to_none=False)
        loss = loss_of(model, b)
        loss.backward()
        if not comm.fused:
            for o in opts:
                o.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        comm.end_step()
        losses.append(loss.item())
        seen.append(counted[0] - counted_before)
        sent.append(comm.bytes_sent(step))
        if rank == 0 and cfg["log_every"] and (step + 1) % cfg["log_every"] == 0:
            print(f"    step {step + 1}/{steps}: {times[-1] * 1e3:.0f} ms, loss {loss.item():.4f}", flush=True)
    dist.all_reduce = original_all_reduce
    link_delta = None
    if link_start is not None:
        dist.barrier()
        link_delta = linkbytes.read(link) - link_start
    node_links: list[Any] = [None] * world
    dist.all_gather_object(node_links, (int(os.environ.get("GROUP_RANK", rank)), link_delta))

    def reduce(values: list[float], op: Any) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return t.tolist()

    times_max = reduce(times, dist.ReduceOp.MAX)
    losses_mean = [v / world for v in reduce(losses, dist.ReduceOp.SUM)]
    cpu_mean = [v / world for v in reduce(cpu, dist.ReduceOp.SUM)]
    if sparse and cfg["hook"] == "allreduce":
        # Gloo's sparse all-reduce all-gathers every rank's coalesced rows: (W-1)/W of all ranks' bytes
        # per rank (a ring all-gather), on top of the ring all-reduce of the dense buckets
        all_rows = reduce(rows_bytes, dist.ReduceOp.SUM)
        dense_ring = ring_bytes(sum(p.numel() * p.element_size() for p in dense_params), world)
        sent = [dense_ring + (world - 1) / world * v for v in all_rows]
    sent_mean = [v / world for v in reduce(sent, dist.ReduceOp.SUM)]
    seen_mean = [v / world for v in reduce(seen, dist.ReduceOp.SUM)]
    extra = comm.details()
    if rank == 0:
        timed = slice(warmup, None)
        result = {
            "median_step_s": statistics.median(times_max[timed]),
            "mean_step_s": statistics.fmean(times_max[timed]),
            "mb_per_step": statistics.fmean(sent_mean[timed]) / 2**20,
            "cpu_ms_per_step": statistics.fmean(cpu_mean[timed]) * 1e3,
            "sparse_gradients": sparse,
            "counted_mb_per_step": statistics.fmean(seen_mean[timed]) / 2**20,
            "dense_mb_per_step": comm.dense_bytes / 2**20,
            "final_loss": statistics.fmean(losses_mean[-LAST_N:]),
            "first_loss": statistics.fmean(losses_mean[:LAST_N]),
            "step_times_s": times_max, "losses": losses_mean, "mb_sent": [v / 2**20 for v in sent_mean],
            "cpu_s": cpu_mean,
            "link": linkbytes.summary(linkbytes.per_node(node_links), steps - warmup),
            "model_info": {"parameters": sum(p.numel() for p in params), "gradient_mb": setup.grad_bytes / 2**20,
                           "embedding_rows": embedding_rows, "row_floats": row_floats,
                           "tensors": len(params)},
            **extra,
        }
        Path(cfg["out"]).write_text(json.dumps(result))
    dist.barrier()
    comm.close()
    del comm, setup, model
    # DDP models left to the cycle collector still hold Gloo work at interpreter exit: collect them while the
    # process group lives (without this, plain DDP aborted at exit in ~15% of runs here, "terminate called
    # without an active exception", with torch 2.13 and Gloo)
    gc.collect()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# one setting, in its own worker processes


def run_setting(net: Network, model: str, hook: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One (model, hook, network): start W workers, wait, return the row (with ``error`` on failure)."""
    tag = f"{model}-{hook}-{net.name}"
    out = tmp / f"{tag}.json"
    cfg = {"model": model, "hook": hook, "steps": args.steps, "warmup": args.warmup, "seed": args.seed,
           "lr": args.lr, "out": str(out), "recsys_batch": args.recsys_batch, "recsys_zipf": args.recsys_zipf,
           "vocab": args.vocab, "lm_dim": args.lm_dim, "lm_batch": args.lm_batch, "lm_seq": args.lm_seq,
           "lm_negatives": args.lm_negatives, "mlp_width": args.mlp_width, "mlp_layers": args.mlp_layers,
           "mlp_batch": args.mlp_batch, "log_every": args.log_every}
    port = net.master_port()
    base_env = {k: v for k, v in os.environ.items() if k not in ("OMNIREDUCE_JOB", "OMNIREDUCE_AGGREGATORS")}
    base_env.update(WORLD_SIZE=str(args.workers), MASTER_ADDR=net.master_addr, MASTER_PORT=str(port),
                    GLOO_SOCKET_IFNAME=net.interface, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if net.aggregators:
        base_env["OMNIREDUCE_AGGREGATORS"] = ",".join(net.aggregators)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)]
    row: dict[str, Any] = {"model": model, "hook": hook, "network": net.name}
    logs = [tmp / f"{tag}-rank{rank}.log" for rank in range(args.workers)]
    agg_cpu = _cpu_seconds(net.aggregator_pids)
    load = os.getloadavg()[0]  # other load on the machine shows up in the times: the 1-minute load, before and after
    t0 = time.monotonic()
    print(f"  {model:<7} {hook:<11} {net.name:<9} ...", flush=True)
    envs = [{**base_env, "RANK": str(r), "LOCAL_RANK": str(r), **net.rank_env(r)} for r in range(args.workers)]
    error = net.run_ranks(cmd, envs, logs, args.setting_timeout, rank0_stdout=True)
    row["wall_s"] = time.monotonic() - t0
    row["loadavg_1min"] = [load, os.getloadavg()[0]]
    if hook.startswith("omnireduce"):  # the aggregators' CPU over the whole setting (warm-up and start included)
        row["agg_cpu_ms_per_step"] = (_cpu_seconds(net.aggregator_pids) - agg_cpu) / args.steps * 1e3
    if error is None and not out.exists():
        error = "rank 0 wrote no result"
    if error is not None:
        row["error"] = error
        print(f"  FAILED: {model} {hook} {net.name}: {error}", file=sys.stderr)
        print_log_tails(logs)
        return row
    row.update(json.loads(out.read_text()))
    print(f"  {model:<7} {hook:<11} {net.name:<9} median step {row['median_step_s'] * 1e3:8.1f} ms  "
          f"{row['mb_per_step']:8.2f} MB/step  loss {row['final_loss']:.4f}  ({row['wall_s']:.0f} s)", flush=True)
    return row


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far (all their threads)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


# ------------------------------------------------------------------------------------------------
# output


def machine() -> dict[str, Any]:
    """Host name, CPU model and count, memory, OS, and the versions of python, torch, numpy, omnireduce."""
    info = machine_info(ROOT)
    info["cpu"] = info.pop("cpu_model")  # this JSON has always called it "cpu"
    return info


# ------------------------------------------------------------------------------------------------
# main


def _csv(allowed: tuple[str, ...] | None) -> Callable[[str], list[str]]:
    def parse(s: str) -> list[str]:
        items = [v.strip() for v in s.split(",") if v.strip()]
        bad = [v for v in items if allowed is not None and v not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed or ())}; got {s!r}")
        return items
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=_csv(MODELS), default=list(DEFAULT_MODELS),
                    help="recsys,lstm (default); recsys-sparse,lstm-sparse: the same with sparse=True tables; "
                         "mlp: a dense MLP")
    ap.add_argument("--hooks", type=_csv(tuple(HOOKS)), default=list(DEFAULT_HOOKS),
                    help="allreduce,omnireduce,fp16,powersgd (also allreduce-fused, omnireduce-fused, "
                         "omnireduce-threshold, ...: ombench.hooks.HOOKS)")
    ap.add_argument("--nets", type=_csv(None), default=["loopback", "1gbit"],
                    help="loopback and/or emulated link rates: 1gbit, 10gbit, ... (root) (default: loopback,1gbit)")
    ap.add_argument("--steps", type=int, default=50, help="training steps per setting (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the step time (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=4, help="W, worker processes (default: %(default)s)")
    ap.add_argument("--aggregators", type=int, default=1, help="omnireduce aggregators (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: %(default)s)")
    ap.add_argument("--recsys-batch", type=int, default=256, help="recommender rows per rank and step")
    ap.add_argument("--recsys-zipf", type=float, default=1.2, help="Zipf exponent of the recommender's ids")
    ap.add_argument("--vocab", type=int, default=100_000, help="LM vocabulary (default: %(default)s)")
    ap.add_argument("--lm-dim", type=int, default=256, help="LM embedding and LSTM width (default: %(default)s)")
    ap.add_argument("--lm-batch", type=int, default=16, help="LM sequences per rank and step (default: %(default)s)")
    ap.add_argument("--lm-seq", type=int, default=32, help="LM tokens per sequence (default: %(default)s)")
    ap.add_argument("--lm-negatives", type=int, default=1024,
                    help="sampled-softmax candidates per rank and step (default: %(default)s)")
    ap.add_argument("--mlp-width", type=int, default=1024, help="MLP inputs and width (default: %(default)s)")
    ap.add_argument("--mlp-layers", type=int, default=4, help="MLP Linear layers (default: %(default)s)")
    ap.add_argument("--mlp-batch", type=int, default=64, help="MLP rows per rank and step (default: %(default)s)")
    ap.add_argument("--setting-timeout", type=float, default=None,
                    help="seconds one setting may take (default: 120 + 30 per step)")
    ap.add_argument("--log-every", type=int, default=0, help="rank 0 prints every N steps (default: never)")
    ap.add_argument("--json", type=Path, default=ROOT / "results" / "bench_train.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "results" / "bench_train.png")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run every requested (network, model, hook); print the table, write the JSON and the plot."""
    args = build_parser().parse_args(argv)
    if args.worker is not None:
        worker_main(json.loads(args.worker))
        return 0
    if args.workers < 2 or args.aggregators < 1:
        sys.exit("bench_train: need --workers >= 2 and --aggregators >= 1")
    if not 0 <= args.warmup < args.steps:
        sys.exit("bench_train: need 0 <= --warmup < --steps")
    if "powersgd" in args.hooks and args.warmup < POWERSGD["start_powerSGD_iter"]:
        print(f"bench_train: note: PowerSGD compresses from step {POWERSGD['start_powerSGD_iter']}; with --warmup "
              f"{args.warmup} the timed steps include uncompressed ones", file=sys.stderr)
    if args.setting_timeout is None:
        args.setting_timeout = 120 + 30 * args.steps
    emulated = [n for n in args.nets if n != "loopback"]
    if emulated:
        for n in emulated:
            try:
                if netem.parse_rate(n) is None:
                    raise ValueError("an unshaped network is not a benchmark setting")
            except ValueError as e:
                sys.exit(f"bench_train: --nets {n}: {e}")
        ok, why = netem.available()
        if not ok:
            sys.exit(f"bench_train: cannot create the emulated {', '.join(emulated)} network: {why}. "
                     "(--nets loopback runs without it.)")
    exit_on_signals("bench_train")  # unwind (and kill the workers) on kill/hang-up

    meta: dict[str, Any] = {
        "argv": sys.argv, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(),
        "loadavg_start": os.getloadavg(),
        "workers": args.workers, "aggregators": args.aggregators, "steps": args.steps, "warmup": args.warmup,
        "seed": args.seed, "optimizer": f"Adam(lr={args.lr}, fused=True)", "loss_over_last_steps": LAST_N,
        "mb": "2**20 bytes", "models": {}, "networks": {},
        "sparse_models": "recsys-sparse / lstm-sparse: the same models with sparse=True tables (SparseAdam for "
                         "them, Adam for the rest); allreduce MB for them: ring of the dense buckets + (W-1)/W of "
                         "all ranks' coalesced rows (8-byte index + row), Gloo's sparse all-gather",
        "data": {"recsys": {"batch_per_rank": args.recsys_batch, "zipf": args.recsys_zipf},
                 "lstm": {"vocab": args.vocab, "dim": args.lm_dim, "lstm_layers": 1, "hidden": args.lm_dim,
                          "batch_per_rank": args.lm_batch, "seq": args.lm_seq, "negatives": args.lm_negatives,
                          "decoder": "tied to the embedding, sampled softmax (log-uniform proposal)",
                          "token_zipf": 1.0},
                 "mlp": {"width": args.mlp_width, "layers": args.mlp_layers, "batch_per_rank": args.mlp_batch,
                         "task": "MSE regression of tanh(x A) b, x ~ N(0, 1), A width x 64, b 64 x 1 fixed"}},
        "ddp": {"backend": "gloo", "gradient_as_bucket_view": True, "forward_sync_buffers": False,
                "threads_per_worker": 1, "timing": "zero_grad+forward+backward+optimizer step, slowest rank"},
        "mb_formulas": {"allreduce": "2(W-1)/W * gradient bytes", "fp16": "2(W-1)/W * gradient bytes / 2",
                        "powersgd": "2(W-1)/W * 4 * (uncompressed elements + sum (n+m)*r) from step "
                                    "start_powerSGD_iter on, allreduce before",
                        "omnireduce": "measured: OmniReduceState.stats()['bytes_sent'] per step"},
        "hooks": {"powersgd": dict(POWERSGD, random_seed=args.seed, serialized_buckets=True),
                  "omnireduce": "OmniReduceState() defaults (block 256 aligned to each bucket's rows, "
                                "path='measure': each dense bucket's path timed both ways for its first 8 "
                                "calls after DDP's rebuild, the faster kept; sparse COO buckets by rows, stacked)",
                  "omnireduce-threshold": "OmniReduceState(path='threshold'): dense once a bucket's union "
                                          "density reaches dense_threshold 0.6",
                  "omnireduce-unaligned": "OmniReduceState(align_blocks=False)",
                  "fp16": "fp16_compress_hook", "allreduce": "DDP default (no hook)"},
    }
    rows: list[dict[str, Any]] = []
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.plot.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    t_start = time.monotonic()
    print(f"bench_train: W={args.workers}, models {','.join(args.models)}, hooks {','.join(args.hooks)}, "
          f"networks {','.join(args.nets)}, {args.steps} steps ({args.warmup} warm-up)", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_train-") as tmpdir:
        tmp = Path(tmpdir)
        for net_name in args.nets:
            with Network(net_name, args.workers, args.aggregators, grace=5.0) as net:
                if any(h.startswith("omnireduce") for h in args.hooks):
                    # the workers read OMNIREDUCE_SOCKET_BUFFER from the environment, the aggregators from a flag
                    buffer = int(os.environ.get("OMNIREDUCE_SOCKET_BUFFER") or 0)
                    net.start_aggregators(port=0 if net.cluster is None else AGG_PORT, socket_buffer=buffer,
                                          logdir=tmp)
                meta["networks"][net_name] = net.info
                for model in args.models:
                    for hook in args.hooks:
                        row = run_setting(net, model, hook, args, tmp)
                        if "model_info" in row:
                            meta["models"][model] = row.pop("model_info")
                        rows.append(row)
                        save()
    meta["total_wall_s"] = time.monotonic() - t_start
    meta["loadavg_end"] = os.getloadavg()
    save()
    print(tables.train_summary(rows, args.workers, args.steps, args.warmup, models=MODELS, last_n=LAST_N))
    if "omnireduce-threshold" in args.hooks:
        print("\n" + tables.path_choice_markdown({"meta": meta, "rows": rows}))
    if importlib.util.find_spec("matplotlib") is not None:
        plots.train_plot(rows, args.plot, args.hooks, args.nets, args.models, LAST_N)
        print(f"\nwrote {args.json} and {args.plot} ({meta['total_wall_s']:.0f} s in all)")
    else:
        print(f"\nwrote {args.json}; no plot (matplotlib is not installed) ({meta['total_wall_s']:.0f} s in all)")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
