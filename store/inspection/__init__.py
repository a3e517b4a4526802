"""Looking at a dataset: statistics, views (tables and figures), the HTML report, the audit report."""
