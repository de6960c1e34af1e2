"""Profiles: the shipped JSON numbers are re-derived here from the architecture definitions.

The three ``_arch_*`` functions are the source of ``policies/profiles/*.json`` (see the README there): each
returns, per layer in forward order, the parameter count (conv/linear weights and biases, batch-norm and
layer-norm scale and shift, embedding tables), the multiply-accumulates (MACs) of one sample's forward pass,
and the layers whose outputs it consumes (only where the graph is not a chain).
"""
from __future__ import annotations

import math

import pytest

from tensorlane.policies.model import Layer, Profile, load_profile, profile_names, scaled

FP32 = 4
BATCH = 32
EFFECTIVE_FLOPS = 10e12  # FLOP/s; see policies/profiles/README.md
SEQ = 128


def _conv(cin: int, cout: int, k: int, hout: int, bias: bool = False, bn: bool = False) -> tuple[int, int]:
    params = cin * cout * k * k + (cout if bias else 0) + (2 * cout if bn else 0)
    return params, cin * cout * k * k * hout * hout


def _arch_resnet50() -> list[tuple[str, int, int, list[str]]]:
    """torchvision resnet50 (v1.5: stride on the 3x3 conv), 224x224 input, 1000 classes; conv+bn as one layer."""
    out: list[tuple[str, int, int, list[str]]] = []
    p, m = _conv(3, 64, 7, 112, bn=True)
    out.append(("conv1", p, m, []))
    cin, hw, prev = 64, 56, ["conv1"]
    for stage, (width, blocks, stride) in enumerate([(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)], start=1):
        cout = width * 4
        for b in range(blocks):
            s = stride if b == 0 else 1
            hout = hw // s
            name = f"layer{stage}.{b}"
            p, m = _conv(cin, width, 1, hw, bn=True)
            out.append((f"{name}.conv1", p, m, list(prev)))
            p, m = _conv(width, width, 3, hout, bn=True)
            out.append((f"{name}.conv2", p, m, [f"{name}.conv1"]))
            p, m = _conv(width, cout, 1, hout, bn=True)
            out.append((f"{name}.conv3", p, m, [f"{name}.conv2"]))
            nxt = [f"{name}.conv3"]
            if b == 0:
                p, m = _conv(cin, cout, 1, hout, bn=True)
                out.append((f"{name}.downsample", p, m, list(prev)))
                nxt.append(f"{name}.downsample")
            prev, cin, hw = nxt, cout, hout
    out.append(("fc", 2048 * 1000 + 1000, 2048 * 1000, list(prev)))
    return out


def _arch_vgg16() -> list[tuple[str, int, int, list[str]]]:
    """torchvision vgg16 (configuration D, no batch norm), 224x224 input, 1000 classes."""
    out: list[tuple[str, int, int, list[str]]] = []
    cin, hw = 3, 224
    for block, (cout, n) in enumerate([(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)], start=1):
        for i in range(1, n + 1):
            p, m = _conv(cin, cout, 3, hw, bias=True)
            out.append((f"conv{block}_{i}", p, m, []))
            cin = cout
        hw //= 2
    for name, fin, fout in [("fc6", 512 * 7 * 7, 4096), ("fc7", 4096, 4096), ("fc8", 4096, 1000)]:
        out.append((name, fin * fout + fout, fin * fout, []))
    return out


def _arch_bert_base() -> list[tuple[str, int, int, list[str]]]:
    """Hugging Face BertModel, bert-base-uncased config (vocab 30522, hidden 768, 12 layers, FFN 3072, 512
    positions, 2 token types, with pooler); sequence length 128. Attention score and context MACs are charged to
    the attention.self group. Embedding lookups and layer norms count as 0 MACs."""
    h, ffn, s = 768, 3072, SEQ
    lin = h * h + h
    out: list[tuple[str, int, int, list[str]]] = [("embeddings", 30522 * h + 512 * h + 2 * h + 2 * h, 0, [])]
    for i in range(12):
        n = f"encoder.{i}"
        out.append((f"{n}.attention.self", 3 * lin, 3 * s * h * h + 2 * s * s * h, []))
        out.append((f"{n}.attention.output", lin + 2 * h, s * h * h, []))
        out.append((f"{n}.intermediate", h * ffn + ffn, s * h * ffn, []))
        out.append((f"{n}.output", ffn * h + h + 2 * h, s * ffn * h, []))
    out.append(("pooler", lin, h * h, []))
    return out


ARCH = {"resnet50": _arch_resnet50, "vgg16": _arch_vgg16, "bert_base": _arch_bert_base}
TOTAL_PARAMS = {"resnet50": 25_557_032, "vgg16": 138_357_544, "bert_base": 109_482_240}


def build_profile_json(name: str) -> dict:
    """The JSON document shipped as policies/profiles/<name>.json (used once to write the files)."""
    arch = ARCH[name]()
    chain = all(not after for _, _, _, after in arch)
    layers = []
    for lname, params, macs, after in arch:
        fwd = 2 * macs * BATCH / EFFECTIVE_FLOPS
        entry = {"name": lname, "params": params, "params_bytes": params * FP32, "fwd_macs_per_sample": macs,
                 "fwd_s": float(f"{fwd:.6e}"), "bwd_s": float(f"{2 * fwd:.6e}")}
        if not chain:
            entry["after"] = after
        layers.append(entry)
    return {"name": name, "layers": layers}


@pytest.mark.parametrize("name", sorted(ARCH))
def test_shipped_profile_matches_architecture(name: str) -> None:
    prof = load_profile(name)
    arch = ARCH[name]()
    assert [ly.name for ly in prof.layers] == [a[0] for a in arch]
    assert [ly.params_bytes for ly in prof.layers] == [a[1] * FP32 for a in arch]
    assert sum(a[1] for a in arch) == TOTAL_PARAMS[name]
    assert prof.total_bytes == TOTAL_PARAMS[name] * FP32
    for layer, (_, _, macs, _) in zip(prof.layers, arch, strict=True):
        assert layer.fwd_s == pytest.approx(2 * macs * BATCH / EFFECTIVE_FLOPS, rel=1e-5)
        assert layer.bwd_s == pytest.approx(2 * layer.fwd_s, rel=1e-5)


def test_known_sizes_and_macs() -> None:
    """Hand-checked: ResNet-50 has 54 conv/fc layers and ~4.1 GMACs; VGG-16 ~15.5 GMACs; BERT-base 50 groups."""
    r = _arch_resnet50()
    assert len(r) == 54 and 4.0e9 < sum(a[2] for a in r) < 4.2e9
    v = _arch_vgg16()
    assert len(v) == 16 and 15.3e9 < sum(a[2] for a in v) < 15.6e9
    assert v[0][1] == 3 * 64 * 9 + 64 == 1792 and v[13][1] == 25088 * 4096 + 4096
    b = _arch_bert_base()
    assert len(b) == 50 and b[0][1] == 23_837_184 and b[1][1] == 1_771_776


def test_profile_names_and_dag() -> None:
    assert profile_names() == ("bert_base", "resnet50", "vgg16")
    r = load_profile("resnet50")
    assert r.dag is not None and len(r.dag) == len(r.layers)
    names = [ly.name for ly in r.layers]
    ds = names.index("layer2.0.downsample")
    # the downsample branch consumes the block input, as conv1 of the same block does
    assert r.dag[ds] == r.dag[names.index("layer2.0.conv1")]
    assert [names[i] for i in r.dag[names.index("layer3.0.conv1")]] == ["layer2.3.conv3"]
    assert load_profile("vgg16").dag is None and load_profile("bert_base").dag is None


def test_scaled() -> None:
    p = Profile("t", (Layer("a", 4, 1.0, 2.0), Layer("b", 8, 0.5, 1.0)))
    q = scaled(p, 3.0)
    assert q.fwd_total == 4.5 and q.bwd_total == 9.0 and q.total_bytes == 12 and q.name == "t"
    with pytest.raises(ValueError):
        scaled(p, -1.0)
    r = load_profile("resnet50")
    assert math.isclose(r.fwd_total * 3, r.fwd_total + r.bwd_total, rel_tol=1e-6)
