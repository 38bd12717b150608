"""Export a ``train_tiny_moe.py`` checkpoint to a llama.cpp glm4moe GGUF (NextN block included).

    python tools/export_glm4moe_gguf.py RUN_DIR [-o OUT.gguf] [--experts F16] [--matrices F16]
                                        [--llama-quantize Q4_K_M] [--check-llama]

Names, shapes, metadata and tokenizer keys are those llama.cpp's ``convert_hf_to_gguf.py`` writes
for GLM-4.5 (``Glm4MoeModel``): keys and their GGUF types through gguf-py's ``GGUFWriter.add_*``;
``block_count`` = trunk layers + 1 with ``nextn_predict_layers = 1``; the NextN block at index
``L = block_count - 1`` carries ``blk.L.nextn.{eh_proj,enorm,hnorm,shared_head_norm}`` plus a full
decoder block (attention, its own router ``ffn_gate_inp``, ``exp_probs_b``, routed experts and
shared expert). ``nextn.embed_tokens`` and ``nextn.shared_head_head`` are left out: the block
shares the trunk's embedding and head, and llama.cpp falls back to ``token_embd``/``output``.
transformers' fused ``gate_up_proj [E, 2I, H]`` is split into ``ffn_gate_exps``/``ffn_up_exps``;
routers, norms and biases stay F32 as the converter forces. The tokenizer is the run's byte-level
BPE (``tokenizer.ggml.model = gpt2``, ``pre = glm4``) with GLM's special-token ids.

``--llama-quantize`` additionally writes ``OUT-<type>.gguf`` with llama.cpp's own quantizer
(``llama_model_quantize``), the only way to get real K-quant blocks here (gguf-py cannot quantize
K-quants). ``--check-llama`` loads the GGUF in llama.cpp (llama-cpp-python) and compares with the
torch model holding the same (dequantized) weights: tokenization of held-out text, top-1 of
every position of greedy continuations, and the greedy continuations themselves; and the NextN
block, run by llama.cpp's own MTP graph (``LLAMA_CONTEXT_TYPE_MTP``) on the same token and
hidden-state inputs, against the torch NextN block's draft logits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_tiny_moe_data as data  # noqa: E402
from train_tiny_moe_model import TinyGlmMoe, load_checkpoint  # noqa: E402


@dataclass(frozen=True)
class Entry:
    """One GGUF tensor and where it lives in the torch model."""

    gguf: str
    param: str                    # state-dict name
    rows: tuple[int, int] | None  # a slice of dim 1 (gate/up halves of gate_up_proj)
    kind: str                     # "f32" | "matrix" | "expert"


def entries(model: TinyGlmMoe) -> list[Entry]:
    """Every tensor llama.cpp's glm4moe loader creates, in file order."""
    c = model.config
    n, I = c.num_hidden_layers, c.moe_intermediate_size
    out = [Entry("token_embd.weight", "lm.model.embed_tokens.weight", None, "matrix")]

    def block(i: int, hf: str, nextn: bool) -> None:
        p = f"blk.{i}."
        if nextn:
            out.extend([Entry(p + "nextn.eh_proj.weight", "mtp.eh_proj.weight", None, "matrix"),
                        Entry(p + "nextn.enorm.weight", "mtp.enorm.weight", None, "f32"),
                        Entry(p + "nextn.hnorm.weight", "mtp.hnorm.weight", None, "f32")])
        out.append(Entry(p + "attn_norm.weight", hf + "input_layernorm.weight", None, "f32"))
        m = hf + "mlp."
        if i < c.first_k_dense_replace and not nextn:
            for x in ("down", "gate", "up"):
                out.append(Entry(f"{p}ffn_{x}.weight", f"{m}{x}_proj.weight", None, "matrix"))
        else:
            out.extend([Entry(p + "ffn_down_exps.weight", m + "experts.down_proj", None, "expert"),
                    Entry(p + "ffn_gate_exps.weight", m + "experts.gate_up_proj", (0, I), "expert"),
                    Entry(p + "ffn_up_exps.weight", m + "experts.gate_up_proj", (I, 2 * I), "expert"),
                    Entry(p + "exp_probs_b.bias", m + "gate.e_score_correction_bias", None, "f32"),
                    Entry(p + "ffn_gate_inp.weight", m + "gate.weight", None, "f32")])
            for x in ("down", "gate", "up"):
                out.append(Entry(f"{p}ffn_{x}_shexp.weight", f"{m}shared_experts.{x}_proj.weight",
                                 None, "matrix"))
        out.append(Entry(p + "post_attention_norm.weight", hf + "post_attention_layernorm.weight",
                         None, "f32"))
        a = hf + "self_attn."
        for x, hx in (("k", "k_proj"), ("output", "o_proj"), ("q", "q_proj"), ("v", "v_proj")):
            if x in ("q", "k"):
                out.append(Entry(f"{p}attn_{x}_norm.weight", f"{a}{x}_norm.weight", None, "f32"))
            if x != "output":
                out.append(Entry(f"{p}attn_{x}.bias", f"{a}{hx}.bias", None, "f32"))
            out.append(Entry(f"{p}attn_{x}.weight", f"{a}{hx}.weight", None, "matrix"))
        if nextn:
            out.append(Entry(p + "nextn.shared_head_norm.weight", "mtp.post_norm.weight", None,
                             "f32"))

    for i in range(n):
        block(i, f"lm.model.layers.{i}.", False)
    block(n, "mtp.mtp_block.", True)
    out += [Entry("output_norm.weight", "lm.model.norm.weight", None, "f32"),
            Entry("output.weight", "lm.lm_head.weight", None, "matrix")]
    return out


def _value(sd: dict[str, torch.Tensor], e: Entry) -> np.ndarray:
    t = sd[e.param].detach().float()
    if e.rows is not None:
        t = t[:, e.rows[0]:e.rows[1]]
    return np.ascontiguousarray(t.numpy())


def _metadata(w, model: TinyGlmMoe, vocab: data.GGUFVocab, name: str, file_type: int) -> None:
    """``Glm4MoeModel.set_gguf_parameters`` + ``_set_vocab_glm``, in the converter's order."""
    from gguf import GGML_QUANT_VERSION, ExpertGatingFuncType
    c = model.config
    w.add_type("model")
    w.add_name(name)
    w.add_block_count(c.num_hidden_layers + 1)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(file_type)
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(float(c.routed_scaling_factor))
    w.add_expert_weights_norm(bool(c.norm_topk_prob))
    w.add_nextn_predict_layers(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("glm4")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    ids = vocab.ids
    w.add_eos_token_id(ids["<|endoftext|>"])
    w.add_pad_token_id(ids["<|endoftext|>"])
    w.add_bos_token_id(ids["[gMASK]"])
    w.add_eot_token_id(ids["<|user|>"])
    w.add_unk_token_id(ids["<|endoftext|>"])
    w.add_eom_token_id(ids["<|observation|>"])
    w.add_chat_template(data.GLM_TEMPLATE)
    w.add_quantization_version(GGML_QUANT_VERSION)


_FILE_TYPE = {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8,
              "Q5_1": 9}


def _encode(a: np.ndarray, qt):
    """(array to write, raw_dtype or None, what llama.cpp will see as float32)."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants
    if qt == T.F32:
        return a, None, a
    if qt == T.F16:
        v = a.astype(np.float16)
        return v, None, v.astype(np.float32)
    q = quants.quantize(a, qt)
    return q, qt, quants.dequantize(q, qt).reshape(a.shape)


def export(run_dir: str, out: str, *, experts: str = "F16", matrices: str = "F16",
           name: str | None = None) -> dict:
    """Write the GGUF; returns a summary (tensor count, bytes, expert bytes per layer)."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    model, meta = load_checkpoint(os.path.join(run_dir, "model.pt"))
    tok = data.load_tokenizer(os.path.join(run_dir, "tokenizer.json"))
    vocab = data.gguf_vocab(tok)
    et, mt = T[experts.upper()], T[matrices.upper()]
    sd = model.state_dict()
    p = model.preset
    w = GGUFWriter(out + ".partial", "glm4moe")
    _metadata(w, model, vocab, name or f"expertfs tiny glm4moe {p.name} seed {meta.get('seed', 0)}",
              _FILE_TYPE.get(et.name, 1))
    n = 0
    for e in entries(model):
        a = _value(sd, e)
        qt = T.F32 if e.kind == "f32" or a.ndim == 1 else (et if e.kind == "expert" else mt)
        if qt not in (T.F32, T.F16) and a.shape[-1] % 32:
            qt = T.F16                          # a row that is not whole blocks stays float
        v, raw, _ = _encode(a, qt)
        w.add_tensor(e.gguf, v, raw_dtype=raw)
        n += 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(out + ".partial", out)
    return {"path": out, "tensors": n, "bytes": os.path.getsize(out), "experts": et.name,
            "matrices": mt.name}


def llama_quantize(src: str, dst: str, ftype: str, threads: int = 2) -> str:
    """llama.cpp's quantizer (``llama-quantize``) on ``src``; ``ftype`` like ``Q4_K_M``."""
    import llama_cpp
    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}", None)
    if code is None:
        raise SystemExit(f"llama.cpp has no file type {ftype!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), llama_cpp.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed ({rc}) on {src}")
    return dst


def load_gguf_weights(model: TinyGlmMoe, path: str) -> TinyGlmMoe:
    """Copy the GGUF's (dequantized) tensors into ``model``: both then hold the same weights."""
    from gguf import GGUFReader, quants
    r = GGUFReader(path)
    by_name = {t.name: t for t in r.tensors}
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for e in entries(model):
            t = by_name[e.gguf]
            shape = tuple(reversed([int(x) for x in t.shape]))
            v = np.array(quants.dequantize(np.asarray(t.data), t.tensor_type),
                         dtype=np.float32).reshape(shape)
            dst = params[e.param]
            if e.rows is not None:
                dst[:, e.rows[0]:e.rows[1]].copy_(torch.from_numpy(v))
            else:
                dst.copy_(torch.from_numpy(v).reshape(dst.shape))
    return model


@torch.no_grad()
def torch_greedy(model: TinyGlmMoe, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy continuation (full recompute each step) and the logits of every position."""
    ids = list(prompt)
    for _ in range(n):
        h = model.trunk(torch.tensor([ids]))
        ids.append(int(model.logits(h[:, -1]).argmax(-1)))
    logits = model.logits(model.trunk(torch.tensor([ids]))).numpy()[0]
    return ids, logits


def check_llama(run_dir: str, gguf_path: str, *, n_prompts: int = 4, prompt_len: int = 32,
                n_gen: int = 32, threads: int = 2) -> dict:
    """llama.cpp against torch on the same weights; returns agreement figures."""
    import llama_cpp
    model, _ = load_checkpoint(os.path.join(run_dir, "model.pt"))
    model.set_experts("eager")
    load_gguf_weights(model, gguf_path)
    tok = data.load_tokenizer(os.path.join(run_dir, "tokenizer.json"))
    held = np.load(os.path.join(run_dir, "held_out.npy")).astype(np.int64)
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=256, use_extra_bufts=False, verbose=False,
                          logits_all=True, n_threads=threads, n_threads_batch=threads,
                          type_k=0, type_v=0, seed=0)
    stride = max(prompt_len + n_gen, (len(held) - prompt_len) // max(1, n_prompts))
    agree = total = same_cont = 0
    max_dlogit = 0.0
    dlogits: list[float] = []
    prefix = []
    tok_ok = tok_n = 0
    for j in range(n_prompts):
        prompt = held[j * stride: j * stride + prompt_len].tolist()
        seq, tl = torch_greedy(model, prompt, n_gen)
        llm.reset()
        llm.eval(seq)
        ll = np.asarray(llm.scores[: len(seq)])
        a, b = tl[prompt_len - 1:-1].argmax(-1), ll[prompt_len - 1:-1].argmax(-1)
        agree += int((a == b).sum())
        total += len(a)
        per_pos = np.abs(tl - ll).max(-1)
        max_dlogit = max(max_dlogit, float(per_pos.max()))
        dlogits.extend(per_pos.tolist())
        llm.reset()                                    # llama.cpp's own greedy continuation
        llm.eval(prompt)
        out = []
        for _ in range(n_gen):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(nxt)
            llm.eval([nxt])
        k = 0
        while k < n_gen and out[k] == seq[prompt_len + k]:
            k += 1
        prefix.append(k)
        same_cont += int(k == n_gen)
        text = tok.decode(held[j * stride: j * stride + 4 * prompt_len].tolist())
        mine = tok.encode(text, add_special_tokens=False).ids
        theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        tok_ok += int(mine == theirs)
        tok_n += 1
    del llm
    return {"top1_agreement": agree / total, "positions": total, "max_abs_dlogit": max_dlogit,
            "median_max_abs_dlogit": float(np.median(dlogits)),
            "greedy_identical": f"{same_cont}/{n_prompts}", "greedy_common_prefix": prefix,
            "n_gen": n_gen, "tokenization_identical": f"{tok_ok}/{tok_n}"}


def _set_embeddings_nextn(ctx, value: bool, masked: bool) -> None:
    """``llama_set_embeddings_nextn`` (llama-ext.h; exported by libllama but not bound by
    llama-cpp-python): what llama.cpp's draft-mtp driver calls on its MTP context."""
    import ctypes

    from llama_cpp import llama_cpp as raw
    f = getattr(raw._lib, "_Z26llama_set_embeddings_nextnP13llama_contextbb", None)
    if f is not None:
        f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None
        f(ctx, value, masked)


@torch.no_grad()
def check_llama_mtp(run_dir: str, gguf_path: str, *, n_tokens: int = 64, threads: int = 1) -> dict:
    """llama.cpp's NextN graph (an MTP context, ``load_mtp``) against the torch NextN block.

    Both get the same inputs: at position p the token t_p and the trunk's normed hidden state
    h_{p-1} (computed by torch), as llama.cpp's draft-mtp catch-up pairs them; a legacy
    ``llama_batch`` carries token ids and state rows together. Compared: the draft logits."""
    import ctypes

    import llama_cpp as L
    model, _ = load_checkpoint(os.path.join(run_dir, "model.pt"))
    model.set_experts("eager")
    load_gguf_weights(model, gguf_path)
    held = np.load(os.path.join(run_dir, "held_out.npy")).astype(np.int64)[:n_tokens]
    ids = torch.from_numpy(held)[None]
    S = ids.shape[1]
    h = model.trunk(ids)[0]
    want = model.logits(model.nextn(ids[:, 1:], h[None, :-1], torch.arange(1, S)[None]))[0].numpy()
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.load_mtp, mp.use_extra_bufts = True, False
    m = L.llama_model_load_from_file(gguf_path.encode(), mp)
    if not m:
        raise RuntimeError(f"llama.cpp could not load {gguf_path} with load_mtp")
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = max(256, S)
    cp.ctx_type, cp.type_k, cp.type_v = L.LLAMA_CONTEXT_TYPE_MTP, 0, 0
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(m, cp)
    n, H = S - 1, h.shape[1]
    b = L.llama_batch_init(n, H, 1)                   # allocates embd; MTP batches carry both
    try:
        _set_embeddings_nextn(ctx, True, True)
        toks = (L.llama_token * n)(*[int(t) for t in held[1:S]])
        b.token = ctypes.cast(toks, ctypes.POINTER(L.llama_token))
        rows = np.ascontiguousarray(h.numpy()[:-1], dtype=np.float32)
        ctypes.memmove(b.embd, rows.ctypes.data, rows.nbytes)
        b.n_tokens = n
        for i in range(n):
            b.pos[i], b.n_seq_id[i], b.logits[i] = i + 1, 1, 1
            b.seq_id[i][0] = 0
        rc = L.llama_decode(ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode on the MTP context returned {rc}")
        V = want.shape[1]
        got = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(V,)).copy()
                        for i in range(n)])
    finally:
        b.token = None                                # ours, not llama_batch_free's
        L.llama_batch_free(b)
        L.llama_free(ctx)
        L.llama_model_free(m)
    return {"positions": n, "top1_agreement": float((got.argmax(1) == want.argmax(1)).mean()),
            "max_abs_dlogit": float(np.abs(got - want).max())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a train_tiny_moe.py output directory")
    ap.add_argument("-o", "--out", help="GGUF path (default RUN_DIR/model-<experts>.gguf)")
    ap.add_argument("--experts", default="F16", help="routed experts: F32, F16, BF16, Q8_0, "
                    "Q4_0, Q4_1, Q5_0, Q5_1 (gguf-py's quantizers)")
    ap.add_argument("--matrices", default="F16", help="other 2-D weights: F32, F16, Q8_0, ...")
    ap.add_argument("--llama-quantize", metavar="FTYPE",
                    help="also write a copy quantized by llama.cpp, e.g. Q4_K_M")
    ap.add_argument("--check-llama", action="store_true",
                    help="compare llama.cpp with torch on the exported weights")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    out = a.out or os.path.join(a.run_dir, f"model-{a.experts.upper()}.gguf")
    t = time.time()
    info = export(a.run_dir, out, experts=a.experts, matrices=a.matrices)
    info["export_s"] = round(time.time() - t, 1)
    paths = [out]
    if a.llama_quantize:
        q = out[:-5] + f"-{a.llama_quantize.upper()}.gguf"
        llama_quantize(out, q, a.llama_quantize, a.threads)
        info["llama_quantized"] = {"path": q, "bytes": os.path.getsize(q)}
        paths.append(q)
    if a.check_llama:
        info["llama_check"] = {p: check_llama(a.run_dir, p, threads=a.threads) for p in paths}
        info["llama_nextn_check"] = {p: check_llama_mtp(a.run_dir, p, threads=a.threads)
                                     for p in paths}
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
