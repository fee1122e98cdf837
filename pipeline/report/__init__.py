"""What a run tells its user: the tally and report, costs, throughput, report.html, trackers."""
