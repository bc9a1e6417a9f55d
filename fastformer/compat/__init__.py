"""Drop-in versions of other Transformer codebases the user's documents describe, on fastformer's kernels.

- `fastformer.compat.aladdinpersson`: the second seed's (002) einsum Transformer.
"""
