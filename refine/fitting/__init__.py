"""The model being fitted: refinable parameters and their transforms, structure factors as parameters, and the objective (image model + loss) one stage minimises."""
