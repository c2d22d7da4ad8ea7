"""How good and how certain the result is: esds from the Fisher information, fit quality against shot noise, identifiability and degeneracy warnings, the spot-offset noise floor."""
