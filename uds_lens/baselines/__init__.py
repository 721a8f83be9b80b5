"""White-box baselines UDS is compared with: per-layer erasure scores in [0, 1] (1 = retain-like) from observing
the models rather than patching them.

* ``hidden``: residual streams at the UDS read positions, one forward per model (what the others consume);
* ``lenses``: logit lens and tuned lens; ``similarity``: CKA, RSA, SVCCA/PWCCA; ``fisher``: masked diagonal Fisher;
  ``probing``: linear probes;
* ``layerwise``: the shared retain-normalised, weighted per-layer form they all report in;
* ``references``: what the full and retain models contribute once (states, lens log-probs, similarities, probes,
  Fisher anchors), reused for every unlearned model by ``analysis.diagnose`` and the meta-evaluation's scorers.

Every model is read through ``uds_lens.sources`` (``TransformerBridge``, Hugging Face model, NF4 alike).
"""
