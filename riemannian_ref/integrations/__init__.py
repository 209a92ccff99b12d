"""Riemannian attention inside other libraries' models.

- :mod:`riemannian_ref.integrations.transformers`: an attention backend for
  Hugging Face ``transformers`` 5.x (``pip install "riemannian_ref[transformers]"``).

Nothing here is imported by ``import riemannian_ref``: each integration imports
its library only when you import the integration.
"""
__all__: list[str] = []
