"""Programmatic dependent launch (kernels/pdl.py): who gets it, and that every kernel launch site passes it.

The protocol itself (griddepcontrol in the sm_90 PTX, the wait before any global access) is checked by the compile
tests (test_kernels_compile, test_kernels_ops_compile); a GPU run of the captured decode graphs with NINFER_PDL=1
against eager launches is in test_graphs.
"""
import ast
from pathlib import Path

import pytest
import torch

from ninfer_kernels import pdl
from ninfer_kernels.ops_common import KernelInputError

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def test_pdl_is_on_by_default_and_off_the_gpu(monkeypatch):
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert pdl.pdl_mode() == "1" and pdl.pdl_kw(torch.device("cpu")) == {}   # griddepcontrol is CUDA (sm_90) PTX
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert pdl.pdl_kw(torch.device("cpu")) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.pdl_kw(torch.device("cuda", 0)) == {}      # the interpreter cannot run it


def test_pdl_on_sm90_only(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    monkeypatch.setattr(pdl, "_capability", lambda index: (9, 0))
    assert pdl.pdl_kw(torch.device("cuda", 0)) == {"PDL": 1, "launch_pdl": True}
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert pdl.pdl_kw(torch.device("cuda", 0)) == {"PDL": 1, "launch_pdl": True}
    monkeypatch.setattr(pdl, "_capability", lambda index: (7, 0))
    assert pdl.pdl_kw(torch.device("cuda", 0)) == {}
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    monkeypatch.setattr(pdl, "_capability", lambda index: (9, 0))
    assert pdl.pdl_kw(torch.device("cuda", 0)) == {}


@pytest.mark.parametrize("kw,env,other", [("preload", pdl.PRELOAD_ENV, pdl.STATE_ENV),
                                           ("state", pdl.STATE_ENV, pdl.PRELOAD_ENV)], ids=["gains", "gdn-state"])
def test_preload_constexpr_only_where_asked_and_pdl_is_on(kw, env, other, monkeypatch):
    """NINFER_PDL_PRELOAD (a norm's gain) and NINFER_PDL_STATE (the GDN state), both default 1, reach the kernels
    that asked for them (pdl_kw(..., preload=True) / state=True) as PRELOAD, each independently of the other, and
    only when PDL itself is on: without the wait there is nothing for the early load to overlap. A bad value is a
    one-line error naming the variable."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for name in (pdl.PDL_ENV, env, other):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pdl, "_capability", lambda index: (9, 0))
    cuda = torch.device("cuda", 0)
    assert pdl.pdl_kw(cuda, **{kw: True}) == {"PDL": 1, "launch_pdl": True, "PRELOAD": 1}
    assert pdl.pdl_kw(cuda) == {"PDL": 1, "launch_pdl": True}
    monkeypatch.setenv(other, "0")
    assert pdl.pdl_kw(cuda, **{kw: True}) == {"PDL": 1, "launch_pdl": True, "PRELOAD": 1}
    monkeypatch.setenv(env, "0")
    assert pdl.pdl_kw(cuda, **{kw: True}) == {"PDL": 1, "launch_pdl": True, "PRELOAD": 0}
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert pdl.pdl_kw(cuda, **{kw: True}) == {}
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    monkeypatch.setenv(env, "on")
    with pytest.raises(KernelInputError, match=f"{env}='on'"):
        pdl.pdl_kw(cuda, **{kw: True})


def test_late_trigger_constexpr_for_the_named_kernels_only(monkeypatch):
    """NINFER_PDL_LATE names the short kernels that trigger at their end (default: the attention combine): the
    launch of a named one gets LATE 1, another LATE 0, a launch that asks for nothing no LATE; off without PDL;
    an unknown name is a one-line error naming the variable."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    monkeypatch.delenv(pdl.LATE_ENV, raising=False)
    monkeypatch.setattr(pdl, "_capability", lambda index: (9, 0))
    cuda = torch.device("cuda", 0)
    assert pdl.late_kernels() == {"combine"} and pdl.pdl_kw(cuda, late="combine")["LATE"] == 1
    assert pdl.pdl_kw(cuda, late="recurrence")["LATE"] == 0
    monkeypatch.setenv(pdl.LATE_ENV, "recurrence, combine")
    assert pdl.late_kernels() == {"recurrence", "combine"}
    assert pdl.pdl_kw(cuda, late="combine")["LATE"] == 1 and pdl.pdl_kw(cuda, late="gated_norm")["LATE"] == 0
    assert "LATE" not in pdl.pdl_kw(cuda)
    monkeypatch.setenv(pdl.LATE_ENV, "none")
    assert pdl.late_kernels() == frozenset()
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert pdl.pdl_kw(cuda, late="combine") == {}
    monkeypatch.setenv(pdl.LATE_ENV, "recurrence,norm")
    with pytest.raises(KernelInputError, match="NINFER_PDL_LATE='recurrence,norm'"):
        pdl.late_kernels()


def test_late_kernels_are_the_ones_launched_with_late():
    """Every kernel with a LATE constexpr is launched with pdl_kw(..., late=<its LATE_KERNELS name>) (the combine
    only in verify steps: late="combine" if max_q_len > 1 else ""), one each."""
    kernels, named = _all_kernels(), {}
    for f in sorted(KERNELS.glob("*.py")):
        for name, call in _launches(ast.parse(f.read_text())):
            for k in call.keywords:
                if k.arg is None and isinstance(k.value, ast.Call) and ast.unparse(k.value.func) == "pdl_kw":
                    late = [a.value for a in k.value.keywords if a.arg == "late"]
                    named.update({c.value: name for v in late for c in ast.walk(v)
                                  if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value})
    assert set(named) == set(pdl.LATE_KERNELS)
    assert {n for n, args in kernels.items() if "LATE" in args} == set(named.values())


def test_ptx_order_with_preload():
    """The compile check's reading of the PTX: a preloading kernel loads before the wait and stores after it."""
    trig, wait = "griddepcontrol.launch_dependents;", "griddepcontrol.wait;"
    ld, st = "ld.global.b32 %r1, [%rd1];", "st.global.b32 [%rd2], %r1;"
    assert pdl.ptx_order_ok("\n".join([trig, wait, ld, st]), 1) is True
    assert pdl.ptx_order_ok("\n".join([trig, ld, wait, st]), 1) is False
    assert pdl.ptx_order_ok("\n".join([trig, ld, wait, st]), 1, preload=1) is True
    assert pdl.ptx_order_ok("\n".join([trig, wait, ld, st]), 1, preload=1) is False   # nothing preloaded
    assert pdl.ptx_order_ok("\n".join([trig, ld, st, wait]), 1, preload=1) is False   # a store before the wait
    assert pdl.ptx_order_ok("\n".join([ld, wait, st]), 1, preload=1) is False          # never triggers


def test_bad_pdl_value_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(pdl.PDL_ENV, "yes")
    with pytest.raises(KernelInputError, match="NINFER_PDL='yes'"):
        pdl.pdl_kw(torch.device("cpu"))


def _jit_kernels(tree) -> dict:
    return {n.name: [a.arg for a in n.args.args] for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.endswith("_kernel")
            and any("jit" in ast.unparse(d) for d in n.decorator_list)}


def _all_kernels() -> dict:
    out = {}
    for f in sorted(KERNELS.glob("*.py")):
        out.update(_jit_kernels(ast.parse(f.read_text())))
    return out


def _launches(tree):
    """(kernel name, call node) of every `name[grid](...)` call."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                and isinstance(node.func.value, ast.Name):
            yield node.func.value.id, node


def test_every_kernel_takes_pdl_and_every_launch_passes_it():
    """Every Triton kernel of the package but the dequantizers (prefill only, launched without PDL, which is safe)
    has the PDL constexpr, and each direct launch of one passes `**pdl_kw(...)`; the GEMV kernels are launched
    by gemv_launch._launch (through their variant wrappers), which adds it for any kernel with the parameter."""
    with_pdl, launches = set(), []
    for f in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(f.read_text())
        for name, args in _jit_kernels(tree).items():
            assert "PDL" in args or "dequant" in name, f"{f.name}: {name} has no PDL constexpr"
            if "PDL" in args:
                with_pdl.add(name)
        launches += [(f.name, name, call) for name, call in _launches(tree)]
    assert {"rmsnorm_kernel", "gdn_recurrent_kernel", "attn_fwd_kernel", "nvfp4_h2_gemv_kernel",
            "nvfp4_mma_gemv_kernel", "q6_k_h2_gemv_kernel"} <= with_pdl
    direct = [(f, name, call) for f, name, call in launches if name in with_pdl]
    assert len(direct) >= 15
    for f, name, call in direct:
        passes = any(k.arg is None and ((isinstance(k.value, ast.Call) and ast.unparse(k.value.func) == "pdl_kw")
                                        or (name.endswith("gemv_kernel") and ast.unparse(k.value) == "kw"))
                     for k in call.keywords)    # a GEMV variant wrapper forwards gemv_launch._launch's **kw
        assert passes, f"{f}: the launch of {name} does not pass **pdl_kw(...)"
    kernels = _all_kernels()
    for f, name, call in direct:   # a kernel with the PRELOAD constexpr is launched with pdl_kw(..., preload=True)
        if "PRELOAD" in kernels[name]:   # (a norm's gain) or pdl_kw(..., state=True) (the GDN state)
            kw = [k for k in call.keywords if k.arg is None and isinstance(k.value, ast.Call)]
            assert any(any(a.arg in ("preload", "state") for a in k.value.keywords) for k in kw), f"{f}: {name}"
    assert {n for n, args in kernels.items() if "PRELOAD" in args} == {
        "rmsnorm_kernel", "gated_rmsnorm_kernel", "add_rmsnorm_gates_kernel", "conv_step_kernel",
        "causal_conv_kernel", "gdn_recurrent_kernel"}
    src = (KERNELS / "gemv_launch.py").read_text()
    assert 'if "PDL" in names:' in src and "pdl_consts(cfg, x.device)" in src and "pdl_kw(device)" in src


def test_mma_gemvs_launch_plainly_under_the_switch(monkeypatch):
    """NINFER_PDL_MMA=0 (a comparison switch) takes the PDL launch attribute off the warp-MMA GEMV launches only;
    they keep the protocol compiled in (their late trigger)."""
    from ninfer_kernels.gemv_launch import GemvConfig, pdl_consts
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    monkeypatch.delenv(pdl.MMA_ENV, raising=False)
    monkeypatch.setattr(pdl, "_capability", lambda index: (9, 0))
    cuda = torch.device("cuda", 0)
    mma, h2 = GemvConfig(128, 8, 4, 2, mma=True), GemvConfig(128, 16, 4, 1, h2=True)
    on = {"PDL": 1, "launch_pdl": True}
    assert pdl_consts(mma, cuda) == on and pdl_consts(h2, cuda) == on
    monkeypatch.setenv(pdl.MMA_ENV, "0")
    assert pdl_consts(mma, cuda) == {"PDL": 1} and pdl_consts(h2, cuda) == on   # triggers, not launched as a dependent
    monkeypatch.setenv(pdl.MMA_ENV, "off")
    with pytest.raises(KernelInputError, match="NINFER_PDL_MMA='off'"):
        pdl_consts(mma, cuda)
