"""Validation against published training runs: the corpus, its predictions, the report."""

from planner.validation.corpus import CorpusRow, load_corpus
from planner.validation.report import RowResult, ValidationReport, validate

__all__ = ["CorpusRow", "RowResult", "ValidationReport", "load_corpus", "validate"]
