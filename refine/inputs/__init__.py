"""What a refinement starts from: measured images, the starting model (flags, header, DIALS), the fitted pixels, spot lists and the synthetic problem bank."""
