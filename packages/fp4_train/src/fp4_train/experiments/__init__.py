"""The experiments behind the committed study results (docs/results): importable modules, each
with a command line (``python -m fp4_train.experiments.<module> --help``).

- ``tp_train``: tensor-, sequence- and pipeline-parallel training of a small byte-level
  transformer whose activations and gradients cross ranks through fp4_comm;
- ``tp_sweep``: presets of ``tp_train`` runs under torchrun (CPU smoke study, the H200 studies);
- ``tp_summary``: the table and loss curves of a folder of runs;
- ``boundary_study``: the pipeline-boundary and sequence-parallel decomposition (forward only,
  backward only, nearest or stochastic rounding), paired against bf16 over seeds, with 95 %
  confidence intervals;
- ``build_corpus``: the BPE corpus (60 MB of English from Debian's documentation packages, a
  16 384-id vocabulary, uint16 token files; docs/tp_training.md, Data);
- ``emulated_tp``: the same training with the k ranks (or the two pipeline stages) emulated in
  one process on one device, bit for bit the k-process run; ``emulated_sweep`` runs its presets
  several processes at a time, ``emulated_summary`` builds the table;
- ``checkpoint``: the checkpoints that resume a ``tp_train`` / ``emulated_tp`` run bit for bit
  (``--checkpoint``, ``--stop-at-s``: a long run in pieces);
- ``corpus``, ``transformer``, ``qwen``, ``records``: the data, the models (byte-level, and a
  Qwen2-style decoder) and the result files they share.

They need fp4-comm and the ``examples`` extra (matplotlib, scipy) beside fp4-train.
"""
