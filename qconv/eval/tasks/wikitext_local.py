"""Helpers referenced from wikitext_local.yaml (`!function`)."""


def nonblank(dataset):
    """wikitext-2-raw separates paragraphs with ' ' lines; they are not documents."""
    return dataset.filter(lambda d: bool(d["text"].strip()))
