from rollouts import main

# Guarded: engines spawn processes that re-import the main module.
if __name__ == "__main__":
    main()
