"""Reports: a run directory's results.json as report.md, report.html and plots (`run`), several axes' runs side by
side (`summary`), both rendered from one list of blocks (`render`)."""

from opct.report.run import read_results, write_report
from opct.report.summary import write_summary

__all__ = ["read_results", "write_report", "write_summary"]
