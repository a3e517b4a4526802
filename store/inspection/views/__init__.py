"""The figures and tables of a dataset, a training run and a logprob audit, shared by the notebooks and
``rollshard-store report`` so the two never drift.

* :mod:`.paths`: where a relative dataset, metrics or tokenizer path given to a notebook points;
* :mod:`.data`: the numbers of each view as polars frames (no plotting);
* :mod:`.figures`: matplotlib figures of a dataset (imported lazily; the ``notebooks`` extra);
* :mod:`.tokens`: one trajectory token by token (HTML and a per-token chart), the multi-agent episode;
* :mod:`.metrics`: a training run's ``metrics.jsonl``;
* :mod:`.mismatch`: the per-token audit report (:data:`rollshard.store.inspection.audit.AUDIT_SCHEMA`);
* :mod:`.html`: tables and figures as self-contained HTML fragments.

Figures are :class:`matplotlib.figure.Figure` objects built without pyplot (no global state, safe in a
command); a notebook shows one with ``display(fig)``.
"""
