"""Integrations of gpattn layers into other libraries' models.

:mod:`gpattn.integrations.huggingface` swaps the self-attention of a pretrained Hugging Face encoder
(BERT, RoBERTa, DistilBERT, all-MiniLM-L6-v2) or decoder (GPT-2 family, Llama) for a gpattn variant:
``pip install 'gpattn[huggingface]'``.
Part of the library (a layer adapter, like a drop-in layer), not of the experiment application; it
imports ``transformers`` only where it must, so ``import gpattn`` never needs it.
"""
