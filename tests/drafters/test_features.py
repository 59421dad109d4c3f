"""What a family reads from a run, as data (drafters/features.py): the layers each question asks for, checked
against hand-written expectations and against the engine's own default (extractor.layers.default_layer_ids)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from drafters.features import Features, aux_layer_spread, aux_layers_for_run, run_fit, union_layer_ids

FUSING = Features(aux_layers=3, top_k=True)  # EAGLE-3, P-EAGLE, DFlash
LAST = Features()  # EAGLE, Medusa, MLPSpeculator


def spec(layer_ids, n=4, top_k=None):
    return SimpleNamespace(layer_ids=tuple(layer_ids), num_hidden_layers=n, target_top_k=top_k)


def test_the_union_over_hsxs_families_is_the_engines_default_for_every_depth():
    from drafters.registry import default_layer_ids, families
    from extractor.layers import default_layer_ids as engine_default

    assert {"eagle", "eagle3", "peagle", "dflash", "medusa", "mlp_speculator"} <= set(families())
    for n in range(1, 81):
        assert union_layer_ids(n, [LAST, FUSING, LAST]) == engine_default(n), n
        assert default_layer_ids(n) == engine_default(n), n
    assert default_layer_ids(32) == (2, 16, 29, 32) and union_layer_ids(32, [LAST]) == (32,)


def test_required_and_extraction_layers():
    assert FUSING.required_layer_ids(32) == (32,)  # no configured aux ids: the run's own are taken
    assert FUSING.required_layer_ids(32, (3, 5)) == (3, 5, 32)
    assert FUSING.extraction_layer_ids(32) == (2, 16, 29, 32)
    assert FUSING.extraction_layer_ids(32, (3, 5)) == (3, 5, 32)
    assert LAST.required_layer_ids(32) == LAST.extraction_layer_ids(32) == (32,)
    assert aux_layer_spread(4) == (2, 1) and aux_layer_spread(32, 4) == (1, 11, 21, 31) and aux_layer_spread(8, 1) == (1,)


def test_run_fit_names_what_is_missing_and_refuses_a_topk_run_only_for_families_reading_n_itself():
    fit = run_fit(LAST, spec((1, 2)))
    assert (fit.needed, fit.missing, fit.top_k_refused, fit.suggested, fit.ok) == ((4,), (4,), False, (1, 2, 4), False)
    assert run_fit(LAST, spec((1, 2, 4))).ok
    topk = spec((1, 2), top_k=8)
    assert run_fit(LAST, topk).top_k_refused and not run_fit(LAST, topk).ok
    fit = run_fit(FUSING, topk)  # the top-k target stands in for N
    assert (fit.needed, fit.missing, fit.ok) == ((), (), True)
    fit = run_fit(FUSING, spec((1, 4)), aux_layer_ids=(3,))
    assert (fit.needed, fit.missing, fit.suggested) == ((3, 4), (3,), (1, 3, 4))


def test_aux_layers_for_run_takes_the_runs_layers_and_names_the_reextraction():
    assert aux_layers_for_run(spec((1, 2, 4)), None, kind="K", uses="fuses", suggest=(2, 4)) == (1, 2)
    assert aux_layers_for_run(spec((1, 2), top_k=8), None, kind="K", uses="fuses", suggest=(2, 4)) == (1, 2)
    with pytest.raises(ValueError, match=r"K fuses, but the run stores only layers \[4\]; .* --layers 2,4"):
        aux_layers_for_run(spec((4,)), None, kind="K", uses="fuses", suggest=(2, 0, 4))
    with pytest.raises(ValueError, match=r"K needs layers \[3, 4\] but the run stores \[1, 4\] \(missing \[3\]\)"):
        aux_layers_for_run(spec((1, 4)), (3,), kind="K", uses="fuses", suggest=(2, 4))


@pytest.mark.parametrize("bad, message", [({"aux_layers": 0}, "aux_layers must be None"),
                                          ({"aux_layers": True}, "aux_layers must be None"),
                                          ({"last_layer": False}, "aux layers, layer N or both"),
                                          ({"aux_layers": 2, "last_layer": False, "top_k": True}, "top_k=True")])
def test_features_refuse_contradictions(bad, message):
    with pytest.raises(ValueError, match=message):
        Features(**bad)


def test_aux_layers_are_trained_in_ascending_order_as_vllm_feeds_them():
    """vLLM captures aux layers sorted and feeds the head's fc in that order: a run (or aux_layer_ids) listing them
    out of order still gives a head whose fc reads them ascending, and whose checkpoint says so."""
    assert aux_layers_for_run(spec((3, 1, 2, 4)), None, kind="K", uses="fuses", suggest=(2, 4)) == (1, 2, 3)
    assert aux_layers_for_run(spec((1, 2, 3, 4)), (3, 1), kind="K", uses="fuses", suggest=(2, 4)) == (1, 3)
