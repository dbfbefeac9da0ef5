"""What the optimizer wrappers are built from: `torch_face` (torch's optimizer API kept by
every wrapper), `master_weights` (`MixPrecisionOptimizer`, fp32 masters) and `grad_agreement`
(ranks agree on grads and misuse before any grad collective; also used by the pipeline)."""
