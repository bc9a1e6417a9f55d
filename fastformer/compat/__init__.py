"""Drop-in versions of other tutorials' Transformers, on fastformer's kernels.

- `fastformer.compat.aladdinpersson`: the einsum seq2seq Transformer of Aladdin Persson's tutorial
  (`transformer_from_scratch.py` in aladdinpersson/Machine-Learning-Collection).
"""
